"""An emulated multi-node cluster on one machine: network namespaces, veth, bridges, tc shaping."""

from ..config.env import FABRIC_ENV
from .fabric import Fabric, build_fabric
from .netns import down, status, up
from .run import run

__all__ = ["FABRIC_ENV", "Fabric", "build_fabric", "down", "run", "status", "up"]

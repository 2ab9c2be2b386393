"""An emulated multi-node cluster on one machine: network namespaces, veth, bridges, tc shaping."""

from .fabric import Fabric, build_fabric
from .netns import down, status, up
from .run import FABRIC_ENV, run

__all__ = ["FABRIC_ENV", "Fabric", "build_fabric", "down", "run", "status", "up"]

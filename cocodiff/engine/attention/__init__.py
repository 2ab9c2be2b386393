"""Attention processors installed through diffusers' `set_processor`, one module per family."""

from .core import UlyssesContext, UlyssesProcessor
from ..families.flux import FluxUlyssesProcessor, overlapped_single_block_forward
from ..families.qwen_image import QwenImageUlyssesProcessor
from ..families.sd3 import SD3UlyssesProcessor

__all__ = [
    "FluxUlyssesProcessor",
    "QwenImageUlyssesProcessor",
    "SD3UlyssesProcessor",
    "UlyssesContext",
    "UlyssesProcessor",
    "overlapped_single_block_forward",
]

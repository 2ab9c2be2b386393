"""Attention over the Ulysses exchange: the generic processor (`core`), the route for diffusers'
dispatcher-based processors (`dispatch`) and ring attention (`ring`). The hand-written processors
of FLUX.1, SD3 and Qwen-Image live with their families (`engine.families.<family>`)."""

from .core import UlyssesContext, UlyssesProcessor

__all__ = ["UlyssesContext", "UlyssesProcessor"]

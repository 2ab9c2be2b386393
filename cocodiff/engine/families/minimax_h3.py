"""MiniMax-H3 (`MiniMaxH3Transformer3DModel`): dispatcher-based, with diffusers' own `_cp_plan`.

One packed sequence holds the video, audio and text rows in the layout's order, each row with its own
timestep index and modality tag; the class's plan splits the sequence at the first block (the
rotary table, the rows' AdaLN indices with it) and gathers it before the output heads. Its refiner
runs over the whole prompt on every rank first.

Its blocks take that one stream and its per-row tables as positional arguments and return one
tensor: the record names their list (`blocks`) and its one stream (`block_streams`), so that a
pipeline stage hands the stream on (the tables are computed on every stage from the same inputs)
and the step caches read a block's input and residual from it; its refiner's blocks run over the
prompt alone and are neither.
"""

from __future__ import annotations

from typing import Any

from .base import Family

__all__ = ["FAMILY"]


def _output(samples: list[Any]) -> Any:
    """Its `return_dict` output from its two samples (video and audio), on a pipeline stage that received them."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerOutput

    return MiniMaxH3TransformerOutput(sample=samples[0], audio_sample=samples[1])


FAMILY = Family(
    blocks="transformer_blocks",  # its refiner's blocks run over the prompt alone, before the split
    block_streams=("hidden_states",),
    stage_output=_output,
    refuses={"patches": "its call is one packed sequence of video, audio and text rows laid out by its row tables, "
                        "with two samples back (video and audio), and displaced patches cut a call's image tokens "
                        "into patches and hand one sample back; use pipeline stages without patches"})
"""MiniMax-H3's `MiniMaxH3Transformer3DModel`."""

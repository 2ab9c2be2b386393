"""MiniMax-H3 (`MiniMaxH3Transformer3DModel`): dispatcher-based, with diffusers' own `_cp_plan`.

One packed sequence holds the video, audio and text rows in the layout's order, each row with its own
timestep index and modality tag; the class's plan splits the sequence at the first block (the
rotary table, the rows' AdaLN indices with it) and gathers it before the output heads. Its refiner
runs over the whole prompt on every rank first.

Its blocks take that one stream and its per-row tables as positional arguments and return one
tensor; the stage cut and the step caches find a transformer's blocks by the two stream arguments
FLUX-style blocks take, so they are refused here.
"""

from __future__ import annotations

from .base import Family

__all__ = ["FAMILY"]

_ONE_STREAM = ("its blocks take one packed sequence of video, audio and text rows and its per-row tables as "
               "positional arguments, and CoCoDiff's {what} reads blocks by their two stream arguments "
               "(hidden_states, encoder_hidden_states)")

FAMILY = Family(refuses={
    "stages": _ONE_STREAM.format(what="stage cut"),
    "patches": _ONE_STREAM.format(what="stage cut, which displaced patches run on,"),
    "step_cache": _ONE_STREAM.format(what="step cache"),
})
"""MiniMax-H3's `MiniMaxH3Transformer3DModel`."""

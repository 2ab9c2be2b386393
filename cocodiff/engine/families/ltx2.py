"""LTX-2 (`LTX2VideoTransformer3DModel`): a video stream and an audio stream in one transformer.

Each block runs the video's self-attention, its cross-attention to the text, the audio's own two,
then audio-to-video and video-to-audio cross-attention (each stream's queries over the other's
keys). diffusers' `_cp_plan` splits the video tokens and the text only: the audio stays whole on
every rank, so the audio's attention and video-to-audio would take a rank's share of video keys
for all of them (the engine refuses that plan: 9 audio q tokens where the layout holds 24). Here
the audio tokens are split too, with their rotary tables, so every attention of a block is over
split tokens of its streams, and both outputs are gathered at the end. The rotary tables are split
on their token axis, -2, whichever their layout ([B, T, D] interleaved, [B, H, T, D/2] split: the
class's plan expects 3 dims, so LTX-2.3's split tables would stay whole). Image-to-video gives
the video tokens their own timestep (a (batch, tokens) tensor: the first frame's at zero), split
with them as LTX-Video's; the audio's own text is whole on every rank (cross-attention to it
stays local). CFG and batch groups gather both samples; a pipeline stage hands both streams on to
the next, and the last stage both samples back; the step caches read both streams and reuse
their residuals; displaced patches are refused.
"""

from __future__ import annotations

from typing import Any

from .base import Family, Gather, ModulePlan, Split, Whole

__all__ = ["FAMILY"]

_ROPE = {0: Split(-2, "img"), 1: Split(-2, "img")}
_AUDIO_ROPE = {0: Split(-2, "audio"), 1: Split(-2, "audio")}


def _output(samples: list[Any]) -> Any:
    """Its `return_dict` output from its two samples, on a pipeline stage that received them."""
    from diffusers.models.transformers.transformer_ltx2 import AudioVisualModelOutput

    return AudioVisualModelOutput(sample=samples[0], audio_sample=samples[1])


FAMILY = Family(
    plan={
        "": ModulePlan(inputs={
            "hidden_states": Split(-2, "img", dims=3), "audio_hidden_states": Split(-2, "audio", dims=3),
            "encoder_hidden_states": Split(-2, "txt", dims=3), "encoder_attention_mask": Split(-1, "txt", dims=2),
            "timestep": Split(-1, "img", dims=2), "audio_encoder_hidden_states": Whole(-2),
        }),
        "rope": ModulePlan(output=_ROPE),
        "cross_attn_rope": ModulePlan(output=_ROPE),
        "audio_rope": ModulePlan(output=_AUDIO_ROPE),
        "cross_attn_audio_rope": ModulePlan(output=_AUDIO_ROPE),
        "proj_out": ModulePlan(output=Gather(-2, "img")),
        "audio_proj_out": ModulePlan(output=Gather(-2, "audio")),
    },
    block_streams=("hidden_states", "audio_hidden_states"),
    stage_output=_output,
    block_outputs=("img", "txt"),  # its blocks return (video, audio): the image stream first
    refuses={"patches": "its blocks hand on two streams (video and audio), and displaced patches keep one "
                        "stream's stale keys and values; use pipeline stages without patches"},
)
"""LTX-2's `LTX2VideoTransformer3DModel`."""

"""HunyuanVideo 1.5 (`HunyuanVideo15Transformer3DModel`): dispatcher-based, with no `_cp_plan`.

Its text refiner (`context_embedder`) runs whole on every rank (its processor calls F.sdpa
directly); the split is at the first block, after the text streams are merged and reordered,
with the text mask for every block and the RoPE tables with their image tokens. Its processor
builds an S x S mask m_i & m_j from the local mask and length: no processor or block change is
needed: dispatch.py runs it as its key mask m over every rank's keys (the form checked once per
module, all ranks agreeing), zeroing the rows of queries whose own bit is False, as one process does.
"""

from __future__ import annotations

from .base import Family, Gather, ModulePlan, Split

__all__ = ["FAMILY"]

FAMILY = Family(
    plan={
        "transformer_blocks.0": ModulePlan(
            inputs={"hidden_states": Split(-2, "img"), "encoder_hidden_states": Split(-2, "txt")}
        ),
        "transformer_blocks.*": ModulePlan(inputs={"attention_mask": Split(-1, "txt")}),
        "rope": ModulePlan(output={0: Split(-2, "img"), 1: Split(-2, "img")}),
        "proj_out": ModulePlan(output=Gather(-2, "img")),
    },
    local=("context_embedder",),
    square_masks=True,
    block_outputs=("img", "txt"),  # its blocks return (hidden_states, encoder_hidden_states)
)
"""HunyuanVideo 1.5's `HunyuanVideo15Transformer3DModel`."""

"""Generic transformers whose `_cp_plan` does not fit the usual shape run as one process, or are
refused in one line.

`RefinedTransformer` stands for a dispatcher-based model CoCoDiff has no record of: a text
refiner (stock `WanAttention`) runs on the whole prompt on every rank before its `_cp_plan`
splits the tokens at the first block; its blocks then attend jointly over the split text and
image. The refiner's attention runs locally (no exchange), decided the same way on every
rank; its second forward must not take the first one's layout for its own. `DeepPlanned` is the
same model without the refiner, its plan written for a 40-block checkpoint on a 2-block config.
diffusers' own MiniMax-H3 transformer has such a refiner too, and splits its rotary table (a row
per token of the packed sequence) before it.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from conftest import RANK_TIMEOUT_S
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models._modeling_parallel import (
    ContextParallelInput,
    ContextParallelOutput,
)
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

from cocodiff import ParallelConfig
from cocodiff.errors import UsageError
from cocodiff.run.launch import spawn

IMAGE, TEXT = 37, 31  # odd on purpose: uneven shares, and the text count divides no world size
RTOL_OF_SCALE = 1e-5  # fp32, one all-to-all pair per layer: rounding only (as tests/test_family_record.py)
CHECKPOINT_DEPTH = 40


def _attention(dim: int, heads: int) -> WanAttention:
    return WanAttention(dim, heads=heads, dim_head=dim // heads, processor=WanAttnProcessor())


class Block(torch.nn.Module):
    """Joint attention over [text, image], the image shifted per token by a tensor every block takes whole."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.attn = _attention(dim, heads)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        joint = torch.cat([encoder_hidden_states, hidden_states + shift], dim=1)
        joint = joint + self.attn(self.norm(joint))
        return joint.split([encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)


def _split(*names: str) -> dict[str, ContextParallelInput]:
    return {name: ContextParallelInput(split_dim=1, expected_dims=3) for name in names}


class RefinedTransformer(ModelMixin, ConfigMixin):
    """Image and text tokens in, image tokens out; the text refined whole before the split."""

    _cp_plan: ClassVar[dict] = {
        "blocks.0": _split("hidden_states", "encoder_hidden_states"),
        "blocks.*": _split("shift"),
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }

    @register_to_config
    def __init__(self, channels: int = 8, dim: int = 32, heads: int = 4, layers: int = 2, refine: bool = True) -> None:
        super().__init__()
        self.proj_in = torch.nn.Linear(channels, dim)
        self.shift_in = torch.nn.Linear(channels, dim)
        self.text_in = torch.nn.Linear(channels, dim)
        self.refiner = _attention(dim, heads) if refine else None
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.proj_out = torch.nn.Linear(dim, channels)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        text = self.text_in(encoder_hidden_states)
        if self.refiner is not None:  # every rank, every text token: before the split
            text = text + self.refiner(text)
        shift = self.shift_in(hidden_states)
        hidden_states = self.proj_in(hidden_states)
        for block in self.blocks:
            text, hidden_states = block(hidden_states, text, shift)
        return self.proj_out(hidden_states)


class DeepPlanned(RefinedTransformer):
    """A plan listing every block of the real checkpoint's depth, on a shallower config."""

    _cp_plan: ClassVar[dict] = {
        "blocks.0": _split("hidden_states", "encoder_hidden_states", "shift"),
        **{f"blocks.{i}": _split("shift") for i in range(1, CHECKPOINT_DEPTH)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _with_plan(plan: dict) -> type:
    return type("Misplanned", (RefinedTransformer,), {"_cp_plan": plan})


def _forwards(cls: type, refine: bool, parallel: bool) -> list[torch.Tensor]:
    """Two forwards (different inputs) of a seeded model: one process, or on every rank after `parallelize`."""
    from cocodiff import parallelize

    torch.manual_seed(0)
    model = cls(refine=refine).eval()
    handle = parallelize(model, ParallelConfig(comm="flat")) if parallel else None
    outs = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        x, text = torch.randn(2, IMAGE, 8, generator=g), torch.randn(2, TEXT, 8, generator=g)
        with torch.no_grad():
            outs.append(model(x, text))
    if handle is not None:
        handle.undo()
    return outs


def _check_equal(cls: type, refine: bool, ranks: int) -> None:
    reference = _forwards(cls, refine, parallel=False)
    for rank, outs in enumerate(spawn(_forwards, ranks, cls, refine, True, timeout_s=RANK_TIMEOUT_S)):
        for call, (out, ref) in enumerate(zip(outs, reference)):
            diff = (out - ref).abs().max().item()
            assert diff <= RTOL_OF_SCALE * ref.abs().max().item(), f"rank {rank} of {ranks}, call {call}: max diff {diff:.3g}"


def test_attention_before_the_split_runs_locally_and_equals_one_process():
    _check_equal(RefinedTransformer, refine=True, ranks=2)


def test_a_plan_deeper_than_the_config_passes_over_the_absent_blocks():
    _check_equal(DeepPlanned, refine=False, ranks=2)


def _minimax_h3(seed: int, parallel: bool, heads: int = 7, rows_of: tuple[int, int, int] = (18, 5, 8),
                plan: str | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two forwards of a tiny MiniMax-H3 (7 heads, as its 56: no power of two divides them; or its 56)
    on a packed sequence of video, audio and text rows (`rows_of`) in a shuffled order, two noise
    levels; under `plan` (a plan's text; None: the default) when `parallel`."""
    from diffusers import MiniMaxH3Transformer3DModel

    from cocodiff import parallelize
    from cocodiff.config.plan import parse_plan

    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=heads, attention_head_dim=16, hidden_size=16 * heads, num_layers=2, num_refiner_layers=1,
        ffn_dim=64, in_channels=8, audio_in_channels=6, text_dim=12, freq_dim=32, time_embed_hidden_dim=32,
        time_embed_dim=16, rope_freq_dim=2).eval()
    config = ParallelConfig(comm="flat", plan=parse_plan(plan) if plan else None)
    handle = parallelize(model, config) if parallel else None
    if handle is not None and plan:
        assert handle.plan.short == plan and (handle.ctx.ring is not None) == ("r" in plan)
    outs = []
    for call in (1, 2):
        g = torch.Generator().manual_seed(call)
        video, audio, text = rows_of  # 31 rows: [8, 8, 8, 7] on 4 ranks, the text's 8 a share of three of them
        rows = video + audio + text
        order = torch.randperm(rows, generator=g)
        text_rows, video_rows, audio_rows = (order[:text].sort().values, order[text:text + video].sort().values,
                                             order[text + video:].sort().values)
        tags = torch.zeros(rows, dtype=torch.long).index_fill(0, text_rows, 1).index_fill(0, audio_rows, 2)
        levels = torch.zeros(rows, dtype=torch.long).index_fill(0, video_rows[:4], 1)  # conditioning rows
        with torch.no_grad():
            outs.append(model(
                hidden_states=torch.randn(1, video, 32, generator=g), audio_hidden_states=torch.randn(1, audio, 6, generator=g),
                encoder_hidden_states=torch.randn(1, text, 12, generator=g), timestep=torch.tensor([0.7, 0.0]),
                timestep_indices=levels, token_tags=tags, position_ids=torch.randint(0, 6, (rows, 3), generator=g).float(),
                video_indices=video_rows, audio_indices=audio_rows, text_indices=text_rows, return_dict=False))
    if handle is not None:
        handle.undo()
    return outs


def test_minimax_h3_through_its_own_plan_equals_one_process():
    """Its refiner attends over the whole prompt on every rank after the rotary table was split:
    that split must not count as the tokens'."""
    reference = _minimax_h3(0, parallel=False)
    for rank, outs in enumerate(spawn(_minimax_h3, 4, 0, True, timeout_s=RANK_TIMEOUT_S)):
        for call, (got, want) in enumerate(zip(outs, reference)):
            for name, out, ref in zip(("video", "audio"), got, want):
                diff = (out - ref).abs().max().item()
                assert diff <= RTOL_OF_SCALE * ref.abs().max().item(), f"rank {rank}, call {call}, {name}: max diff {diff:.3g}"


@pytest.mark.parametrize(("ranks", "plan"), [(8, "u8"), (16, "u16"), (16, "u8r2")])
def test_minimax_h3_with_its_56_heads_on_8_and_16_ranks_equals_one_process(ranks, plan):
    """Its 56 heads: 7 a rank on 8, 3 or 4 on 16 (uneven), or 7 with a ring of 2 past the heads; 207
    packed rows, uneven shares on every rank."""
    args = (56, (150, 37, 20))
    reference = _minimax_h3(0, False, *args)
    for rank, outs in enumerate(spawn(_minimax_h3, ranks, 0, True, *args, plan, timeout_s=RANK_TIMEOUT_S)):
        for call, (got, want) in enumerate(zip(outs, reference)):
            for name, out, ref in zip(("video", "audio"), got, want):
                diff = (out - ref).abs().max().item()
                assert diff <= RTOL_OF_SCALE * ref.abs().max().item(), f"rank {rank}, call {call}, {name}: max diff {diff:.3g}"


def _refusal(plan: dict) -> str:
    from cocodiff import parallelize

    with pytest.raises(UsageError) as error:
        parallelize(_with_plan(plan)(refine=False), ParallelConfig(comm="flat"), topology=object())
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_plan_naming_a_module_the_class_lacks_is_refused_in_one_line():
    plan = {**RefinedTransformer._cp_plan, "text_blocks.0": _split("encoder_hidden_states")}
    assert _refusal(plan) == "Misplanned has no module 'text_blocks.0', which its split plan names"


def test_a_gather_past_the_last_block_is_refused_in_one_line():
    plan = {"blocks.0": RefinedTransformer._cp_plan["blocks.0"],
            f"blocks.{CHECKPOINT_DEPTH - 1}": ContextParallelOutput(gather_dim=1, expected_dims=3)}
    message = _refusal(plan)
    assert message.startswith("Misplanned's split plan gathers at 'blocks.39', past the end of its blocks (2 modules)")

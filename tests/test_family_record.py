"""A new family is one record and one registry line: nothing else in the engine changes.

`ToyTransformer` stands for a dispatcher-based diffusers model that CoCoDiff has never seen and
that declares no `_cp_plan` (its attention is Wan's stock `WanAttention`, whose processor calls
diffusers' attention dispatcher). `TOY` is the whole of what a new `engine/families/toy.py`
would hold, and `_register` is the one line `FAMILIES` would gain; with them it runs on 2 and 4
ranks exactly as in one process, and without them its plan is inferred from the model
(engine/plan_inference.py).
"""

from __future__ import annotations

import pytest
import torch
from conftest import RANK_TIMEOUT_S
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

from cocodiff import ParallelConfig
from cocodiff.engine.families import FAMILIES, Family, Gather, ModulePlan, Split
from cocodiff.errors import UsageError
from cocodiff.run.launch import spawn

TOKENS = 37  # odd on purpose: uneven shares on 2 and 4 ranks
RTOL_OF_SCALE = 1e-5  # fp32, one all-to-all pair per layer: rounding only (as tests/test_models.py, tighter)


class ToyBlock(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.attn = WanAttention(dim, heads=heads, dim_head=dim // heads, processor=WanAttnProcessor())
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.norm(hidden_states))
        return hidden_states + self.mlp(hidden_states)


class ToyTransformer(ModelMixin, ConfigMixin):
    """Tokens in, tokens out, through `layers` blocks of stock dispatcher-based attention; no `_cp_plan`."""

    @register_to_config
    def __init__(self, channels: int = 8, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.proj_in = torch.nn.Linear(channels, dim)
        self.blocks = torch.nn.ModuleList(ToyBlock(dim, heads) for _ in range(layers))
        self.proj_out = torch.nn.Linear(dim, channels)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # (B, S, C) -> (B, S, C)
        hidden_states = self.proj_in(hidden_states)
        for block in self.blocks:
            hidden_states = block(hidden_states)
        return self.proj_out(hidden_states)


# What a new engine/families/toy.py holds: the tokens split at the first block, gathered at the exit.
TOY = Family(
    plan={
        "blocks.0": ModulePlan(inputs={"hidden_states": Split(-2, "img")}),
        "proj_out": ModulePlan(output=Gather(-2, "img")),
    },
    batch_args=("hidden_states",),
)


def _register() -> None:
    FAMILIES["ToyTransformer"] = TOY  # the one line the registry gains


def _toy_run(register: bool) -> torch.Tensor:
    from cocodiff import parallelize

    torch.manual_seed(0)
    model = ToyTransformer().eval()
    x = torch.randn(2, TOKENS, 8, generator=torch.Generator().manual_seed(1))
    if not register:
        with torch.no_grad():
            return model(x)
    _register()
    parallel = parallelize(model, ParallelConfig(comm="flat"))
    with torch.no_grad():
        out = model(x)
    parallel.undo()
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_family_record_and_its_registry_line_run_a_new_model_exactly(ranks):
    reference = _toy_run(register=False)
    outs = spawn(_toy_run, ranks, True, timeout_s=RANK_TIMEOUT_S)
    for rank, out in enumerate(outs):
        diff = (out - reference).abs().max().item()
        assert diff <= RTOL_OF_SCALE * reference.abs().max().item(), f"rank {rank} of {ranks}: max diff {diff:.3g}"


def test_without_its_record_the_new_model_gets_its_plan_inferred():
    """With no record and no `_cp_plan`, the plan is inferred from a traced forward: TOY's split at
    the first block, gathered at the last block's output (TOY gathers after `proj_out`, per token)."""
    from cocodiff.engine.plan_inference import infer_plan

    FAMILIES.pop("ToyTransformer", None)
    torch.manual_seed(0)
    x = torch.randn(2, TOKENS, 8)
    assert infer_plan(ToyTransformer().eval(), (x,), {}) == {
        "blocks.0": ModulePlan(inputs={"hidden_states": Split(-2, "img")}),
        "blocks.1": ModulePlan(output=Gather(-2, "img")),
    }
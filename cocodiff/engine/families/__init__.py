"""What CoCoDiff knows of each diffusers transformer class, in one place.

A *family* is a transformer class. Its entry says where the tokens are split and gathered (a plan:
written here, or read as data from the class's own `_cp_plan`), which forward arguments carry the
batch (CFG and batch groups share them), and, for the few classes whose attention bypasses the
diffusers attention dispatcher, the hand-written processor that replaces theirs.

A transformer whose attention goes through the dispatcher and that declares a `_cp_plan` needs no
entry at all: `family_of` gives it the generic family, and `parallelize` runs its stock processors
with the exchange of `attention/dispatch.py`. An entry is needed only to add what the class does
not say: a plan where it has none (Z-Image, HunyuanVideo 1.5), a stream label the names do not
give, a faster hand-written path (FLUX.1's overlapped single blocks), a second expert.

Plans use negative sequence dims, so a plan holds with or without a batch dim.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cocodiff.errors import UsageError

__all__ = [
    "Family", "FAMILIES", "Gather", "ModulePlan", "Split", "batch_args", "class_name", "family_of", "from_cp_plan", "module_plans", "stream_of",
]


@dataclass(frozen=True)
class Split:
    """Keep this rank's share of a tensor along `dim`, a token axis of `stream` ('txt' or 'img')."""

    dim: int
    stream: str
    dims: int | None = None
    """Split only a tensor of this many dims (diffusers' `expected_dims`: e.g. Wan's timestep is
    split only when it has one value per token); None: any."""


@dataclass(frozen=True)
class Gather:
    """All-gather this rank's share along `dim` so every rank holds the whole tensor."""

    dim: int
    stream: str


@dataclass(frozen=True)
class ModulePlan:
    inputs: dict[str, Split] = field(default_factory=dict)
    """Forward arguments (by name) split before the module runs."""
    output: Split | Gather | dict[int, Split] | None = None
    """What happens to the module's output (or to the listed items of a tuple output)."""


@dataclass(frozen=True)
class Family:
    """One transformer class: its plan, its batch arguments, its optional hand-written parts."""

    plan: dict[str, ModulePlan] | None = None
    """Module path ('' for the transformer itself; '*' matches one path component) -> plan;
    None: the class's `_cp_plan`, read as data (`from_cp_plan`)."""
    streams: dict[str, str] = field(default_factory=dict)
    """Stream labels of `_cp_plan` entries that their names do not give ('pos_embed.1' -> 'txt')."""
    processor: type | None = None
    """A hand-written attention processor (attention/*.py) in place of the stock ones; None: the
    stock processors run unchanged and their dispatcher calls reach the exchange (dispatch.py)."""
    batch_args: tuple[str, ...] | None = None
    """Forward arguments that carry the batch (split across CFG / batch groups); None: every
    argument whose leading dim is the batch."""
    overlapped_forwards: dict[str, Callable[..., Any]] = field(default_factory=dict)
    """Block class name -> a forward that runs independent work while attention's output travels
    (installed with V-First)."""
    repeated_blocks: tuple[str, ...] | None = None
    """Block class names compiled one by one under `compile`; None: the class's `_repeated_blocks`."""
    experts: tuple[str, ...] = ()
    """Further transformers of the pipeline parallelized the same way (Wan 2.2 A14B: 'transformer_2')."""
    local: tuple[str, ...] = ()
    """Module paths whose attention runs before the split, on whole sequences on every rank: their
    processors keep their own attention (Z-Image's refiners, HunyuanVideo 1.5's text refiner)."""
    square_masks: bool = False
    """The processors build an (S, S) mask m_i & m_j from a token mask m over their own tokens
    (HunyuanVideo 1.5): run it as the key mask m over every rank's keys (dispatch.py)."""


def _hand_written() -> dict[str, Family]:
    from .flux import FluxUlyssesProcessor, overlapped_single_block_forward
    from .qwen_image import QwenImageUlyssesProcessor
    from .sd3 import SD3UlyssesProcessor

    return {
        # Tokens and their position ids split at the entry, so RoPE is computed per shard.
        "FluxTransformer2DModel": Family(
            plan={
                "": ModulePlan(inputs={
                    "hidden_states": Split(-2, "img"), "encoder_hidden_states": Split(-2, "txt"),
                    "img_ids": Split(-2, "img"), "txt_ids": Split(-2, "txt"),
                }),
                "proj_out": ModulePlan(output=Gather(-2, "img")),
            },
            processor=FluxUlyssesProcessor,
            # img_ids / txt_ids have no batch dim (positions are shared by the batch).
            batch_args=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"),
            # Single-stream blocks compute an MLP branch from the attention's input: it can run
            # while the attention output is exchanged.
            overlapped_forwards={"FluxSingleTransformerBlock": overlapped_single_block_forward},
            repeated_blocks=("FluxTransformerBlock", "FluxSingleTransformerBlock"),
        ),
        # The input is a latent image; it becomes tokens (with learned position embeddings) in
        # pos_embed, so the split happens on pos_embed's output; unpatchify needs the gathered tokens.
        "SD3Transformer2DModel": Family(
            plan={
                "pos_embed": ModulePlan(output=Split(-2, "img")),
                "context_embedder": ModulePlan(output=Split(-2, "txt")),
                "proj_out": ModulePlan(output=Gather(-2, "img")),
            },
            processor=SD3UlyssesProcessor,
            batch_args=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"),
            repeated_blocks=("JointTransformerBlock",),
        ),
        # Split at the first block, after the text mask and RoPE tables are built from the full text
        # length; the RoPE tables are split with their tokens; the text mask stays whole (the
        # processor lays it out in the gathered key order).
        "QwenImageTransformer2DModel": Family(
            plan={
                "transformer_blocks.0": ModulePlan(
                    inputs={"hidden_states": Split(-2, "img"), "encoder_hidden_states": Split(-2, "txt")}
                ),
                "transformer_blocks.*": ModulePlan(inputs={"modulate_index": Split(-1, "img")}),
                "pos_embed": ModulePlan(output={0: Split(-2, "img"), 1: Split(-2, "txt")}),
                "proj_out": ModulePlan(output=Gather(-2, "img")),
            },
            streams={"pos_embed.1": "txt"},  # its `_cp_plan`'s second RoPE table is the text's
            processor=QwenImageUlyssesProcessor,
            # img_shapes and txt_seq_lens are per-item lists.
            batch_args=("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep",
                        "img_shapes", "txt_seq_lens", "guidance"),
            repeated_blocks=("QwenImageTransformerBlock",),
        ),
    }


FAMILIES: dict[str, Family] = {
    **_hand_written(),
    # Dispatcher-based with a `_cp_plan`: nothing but what the class does not say (FLUX.2, LTX-Video
    # and any other such class need no entry).
    # Wan keeps the text whole (its cross-attention is local on every rank: no exchange).
    "WanTransformer3DModel": Family(
        batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
        experts=("transformer_2",),
    ),
    # Z-Image has no _cp_plan. Its refiners run whole on every rank (image tokens alone, text alone:
    # 2 + 2 of its 34 layers); the split is at the main layers, whose input is one sequence
    # [image, text] (each part padded to a multiple of 32), split as one stream with its RoPE table
    # and key mask (None when every item has the same length). The final layer's output is gathered
    # whole, so unpatchify finds the image tokens at the front as in one process.
    "ZImageTransformer2DModel": Family(
        plan={
            "layers.0": ModulePlan(inputs={"x": Split(-2, "img")}),
            "layers.*": ModulePlan(inputs={"attn_mask": Split(-1, "img", dims=2), "freqs_cis": Split(-2, "img")}),
            "all_final_layer.*": ModulePlan(output=Gather(-2, "img")),
        },
        local=("noise_refiner", "context_refiner", "siglip_refiner"),
    ),
    # HunyuanVideo 1.5 has no _cp_plan. Its text refiner (context_embedder) runs whole on every rank
    # (its processor calls F.sdpa directly); the split is at the first block, after the text streams
    # are merged and reordered, with the text mask for every block and the RoPE tables with their
    # image tokens. Its processor builds an S x S mask m_i & m_j from the local mask and length:
    # no processor or block change is needed: dispatch.py runs it as its key mask m over every
    # rank's keys (the form checked once per module, all ranks agreeing), zeroing the rows of
    # queries whose own bit is False, as one process does.
    "HunyuanVideo15Transformer3DModel": Family(
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
    ),
}
"""Transformer class name -> its family; a class with a `_cp_plan` and no entry is generic."""


def class_name(module: torch.nn.Module) -> str:
    """The name of `module`'s own class, also once FSDP2 (`--shard-weights`) has put it in a
    subclass of its own (`FSDP<Name>`, whose bases are FSDPModule and the class)."""
    cls = type(module)
    if cls.__name__.startswith("FSDP"):
        from torch.distributed.fsdp import FSDPModule

        if issubclass(cls, FSDPModule):
            cls = next(base for base in cls.__bases__ if base is not FSDPModule)
    return cls.__name__


def family_of(transformer: torch.nn.Module) -> Family:
    """The family of `transformer`; a one-line UsageError naming the class and why it cannot run."""
    name = class_name(transformer)
    if name in FAMILIES:
        return FAMILIES[name]
    if getattr(transformer, "_cp_plan", None):
        return Family()
    raise UsageError(f"{name} cannot run sequence-parallel: it declares no _cp_plan and CoCoDiff has no plan "
                     f"for it (supported: {', '.join(FAMILIES)}, and any class with a _cp_plan)")


def batch_args(family: Family, transformer: torch.nn.Module) -> tuple[str, ...]:
    """Forward arguments that carry the batch: the family's, else every forward argument (only a
    value whose leading dim is the call's batch is split; see data_parallel.py)."""
    if family.batch_args is not None:
        return family.batch_args
    return tuple(inspect.signature(type(transformer).forward).parameters)[1:]


def module_plans(family: Family, transformer: torch.nn.Module) -> dict[str, ModulePlan]:
    """The family's plan, or the class's `_cp_plan` read as data."""
    if family.plan is not None:
        return family.plan
    return from_cp_plan(transformer._cp_plan, family.streams, type(transformer).__name__)


def stream_of(name: str | int, path: str, overrides: dict[str, str]) -> str:
    """'txt' for arguments named encoder_* / txt_* (and overrides), else 'img'."""
    key = f"{path}.{name}" if path else str(name)
    if key in overrides:
        return overrides[key]
    return "txt" if isinstance(name, str) and name.startswith(("encoder_", "txt_", "text_")) else "img"


def from_cp_plan(cp_plan: dict[str, Any], streams: dict[str, str] | None = None, owner: str = "") -> dict[str, ModulePlan]:
    """diffusers' `_cp_plan` (ContextParallelInput / ContextParallelOutput by module path) -> our plan.

    Splits become uneven (`split_sizes`, no divisibility needed) and remember their stream, so the
    exchange knows every rank's tokens of each stream without a collective.
    """
    from diffusers.models._modeling_parallel import (
        ContextParallelInput,
        ContextParallelOutput,
    )

    overrides = streams or {}

    def negative(dim: int, dims: int | None) -> int:
        return dim - dims if dim >= 0 and dims is not None else dim

    plans: dict[str, ModulePlan] = {}
    for path, spec in cp_plan.items():
        if isinstance(spec, ContextParallelOutput):
            plans[path] = ModulePlan(output=Gather(negative(spec.gather_dim, spec.expected_dims), "img"))
            continue
        if not isinstance(spec, dict):
            raise UsageError(f"{owner}._cp_plan[{path!r}]: {type(spec).__name__} is not supported (one spec per tensor)")
        inputs: dict[str, Split] = {}
        outputs: dict[int, Split] = {}
        for name, item in spec.items():
            if not isinstance(item, ContextParallelInput):
                raise UsageError(f"{owner}._cp_plan[{path!r}][{name!r}]: {type(item).__name__} is not supported")
            split = Split(negative(item.split_dim, item.expected_dims), stream_of(name, path, overrides), item.expected_dims)
            if item.split_output:
                outputs[int(name)] = split
            else:
                inputs[str(name)] = split
        plans[path] = ModulePlan(inputs=inputs, output=outputs or None)
    return plans

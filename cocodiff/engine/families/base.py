"""The types every family is written in: where tokens split and gather (`Split`, `Gather`,
`ModulePlan`) and what the engine knows of one transformer class (`Family`).

Plans use negative sequence dims, so a plan holds with or without a batch dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["JOINT", "Family", "Gather", "ModulePlan", "Split", "Whole", "block_lists", "class_name", "repeated_block_names"]

JOINT = "+"
"""Joins two stream names into a joint stream ('txt+img': a table of the text's rows, then the image's)."""
_LISTS = (torch.nn.ModuleList, torch.nn.Sequential)


@dataclass(frozen=True)
class Split:
    """Keep this rank's share of a tensor along `dim`, a token axis of `stream` ('txt' or 'img')."""

    dim: int
    stream: str
    dims: int | None = None
    """Split only a tensor of this many dims (diffusers' `expected_dims`: e.g. Wan's timestep is
    split only when it has one value per token); None: any."""


@dataclass(frozen=True)
class Whole:
    """A forward argument every rank holds whole: the keys and values of an attention that stays
    local (each rank's split queries over all of it: no exchange). Its token count along `dim` is
    recorded in each forward pass, so that the attention over it is told from one over split tokens."""

    dim: int


@dataclass(frozen=True)
class Gather:
    """All-gather this rank's share along `dim` so every rank holds the whole tensor."""

    dim: int
    stream: str


@dataclass(frozen=True)
class ModulePlan:
    inputs: dict[str, Split | Whole] = field(default_factory=dict)
    """Forward arguments (by name) split before the module runs (or left whole, their count noted)."""
    output: Split | Gather | dict[int, Split] | None = None
    """What happens to the module's output (or to the listed items of a tuple output)."""


@dataclass(frozen=True)
class Family:
    """One transformer class: its plan, its batch arguments, its optional hand-written parts."""

    plan: dict[str, ModulePlan] | None = None
    """Module path ('' for the transformer itself; '*' matches one path component) -> plan;
    None: the class's `_cp_plan`, read as data (`from_cp_plan`)."""
    infer: bool = False
    """No plan written and no `_cp_plan`: the plan is inferred from the model at its first call
    (engine/plan_inference.py)."""
    streams: dict[str, str] = field(default_factory=dict)
    """Stream labels of `_cp_plan` entries that their names do not give ('pos_embed.1' -> 'txt')."""
    inputs: dict[str, dict[str, Split]] = field(default_factory=dict)
    """Splits of module inputs the class's `_cp_plan` does not list, added to it (module path ->
    argument -> split): LTX-Video's per-token timestep in image-to-video."""
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
    reference_tokens: Callable[[dict[str, Any]], int | None] | None = None
    """Tokens an edit's reference images add to the sequence, from the transformer's call
    arguments, where its latents are not one packed (B, S, C) `hidden_states` (Z-Image-Omni's
    nested lists); None: read from `hidden_states` (`run.pipeline`)."""
    local: tuple[str, ...] = ()
    """Module paths whose attention runs before the split, on whole sequences on every rank: their
    processors keep their own attention (Z-Image's refiners, HunyuanVideo 1.5's text refiner)."""
    square_masks: bool = False
    """The processors build an (S, S) mask m_i & m_j from a token mask m over their own tokens
    (HunyuanVideo 1.5): run it as the key mask m over every rank's keys (dispatch.py)."""
    block_outputs: tuple[str, str] = ("txt", "img")
    """The order of the two streams a block returns when it returns two (HunyuanVideo 1.5: image
    first); a block that returns one tensor returns the image stream, or FLUX.2's single-stream
    blocks the streams joined, text first (the step caches read it: engine/cache/steps.py)."""
    block_streams: tuple[str, ...] = ("hidden_states", "encoder_hidden_states")
    """A block's arguments that carry the two streams its blocks change, image first (LTX-2: its
    video and audio, its text being the same at every block; MiniMax-H3: its one packed stream): what
    a pipeline stage hands on to the next stage's first block, and what the step caches read as a
    block's input and residuals."""
    blocks: str | None = None
    """The transformer's list of the blocks that run over the sequence, named where its blocks take
    another signature than the two streams' (MiniMax-H3's one stream and its per-row tables): the
    blocks the stage cut and the step caches take; None: the lists whose blocks take both streams
    (engine/cache/steps.py `cache_blocks`)."""
    stage_output: Callable[[list[torch.Tensor]], Any] | None = None
    """The transformer's `return_dict` output built from its samples, on a stage that only received
    them (None: one sample, diffusers' `Transformer2DModelOutput`)."""
    refuses: dict[str, str] = field(default_factory=dict)
    """What of the engine this family cannot have -> why, refused in one line before any rank loads
    weights (`refusal`): 'data_groups' (CFG and batch groups splitting its calls' batch), 'stages'
    (pipeline stages), 'ring' (a plan with a ring), 'patches' (displaced patches through the stages),
    'step_cache', 'plan_trials' (`--plan auto`'s trials), 'v_major' (`--v-major`)."""
    sample_inputs: Callable[..., dict[str, Any]] | None = None
    """(config, randn, timestep, context, h, w, text, batch) -> made-up arguments for one forward of a
    bare transformer (sample_inputs.py); None: no made-up inputs for this family."""
    activation_factor: float | None = None
    """Values per token and hidden channel alive at the peak of one block, measured (footprint's
    `ACTIVATION_FACTOR` otherwise)."""
    entry_factor: float = 0.0
    """Values of the image tokens' rows alive at the entry when the image is embedded whole before
    the split (the peak of a rank once sp is large: footprint's `plan_activations`)."""
    plan_values: tuple[float, float] = (0, 0)
    """Extra values of a rank's rows alive under any sequence-parallel plan, and more under ring
    (footprint's `plan_activations`)."""



def class_name(module: torch.nn.Module) -> str:
    """The name of `module`'s own class, also once FSDP2 (`--shard-weights`) has put it in a
    subclass of its own (`FSDP<Name>`, whose bases are FSDPModule and the class)."""
    cls = type(module)
    if cls.__name__.startswith("FSDP"):
        from torch.distributed.fsdp import FSDPModule

        if issubclass(cls, FSDPModule):
            cls = next(base for base in cls.__bases__ if base is not FSDPModule)
    return cls.__name__


def repeated_block_names(transformer: torch.nn.Module, family: Family) -> tuple[str, ...]:
    """Block class names compiled (`--compile`) and sharded (`--shard-weights`) one by one: the
    family's `repeated_blocks`, else the class's `_repeated_blocks`, else (a class that names none,
    its plan inferred) the classes of the blocks of its own block lists with attention."""
    if family.repeated_blocks is not None:
        return family.repeated_blocks
    named = tuple(getattr(transformer, "_repeated_blocks", None) or ())
    return named or tuple(dict.fromkeys(class_name(block) for _, blocks in block_lists(transformer) for block in blocks))


def block_lists(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The transformer's own block lists whose blocks hold attention, but refiners."""
    lists = []
    for name, child in transformer.named_children():
        if isinstance(child, _LISTS) and len(child) and "refiner" not in name and \
                any(hasattr(m, "processor") for m in child.modules()):
            lists.append((name, child))
    return lists

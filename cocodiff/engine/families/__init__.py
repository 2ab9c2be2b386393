"""What CoCoDiff knows of each diffusers transformer class: one module per family, one registry.

A *family* is a transformer class. Its record (`base.Family`, in `<family>.py`) says where the
tokens are split and gathered (a plan: written there, or read as data from the class's own
`_cp_plan`), which forward arguments carry the batch (CFG and batch groups share them), its
experts, its footprint factors, its made-up forward inputs, and, for the few classes whose
attention bypasses the diffusers attention dispatcher, the hand-written processor that replaces
theirs. Pipeline classes (guidance, CFG, img2img, prompts) are `pipelines.py`'s.

A transformer whose attention goes through the dispatcher and that declares a `_cp_plan` needs no
record at all: `family_of` gives it the generic family, and `parallelize` runs its stock processors
with the exchange of `engine/attention/dispatch.py`. A record is needed only to add what the class does
not say: a plan where it has none (Z-Image, HunyuanVideo 1.5), a stream label the names do not
give, a faster hand-written path (FLUX.1's overlapped single blocks), a second expert.

Adding a family is one module beside these (its `FAMILY` record) and one line in `FAMILIES`.
The reach into diffusers' private `_modeling_parallel` (the `_cp_plan` types) is here, in
`from_cp_plan`, and nowhere else in this package.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...errors import UsageError
from . import chroma, flux, hunyuanvideo15, ltx, ltx2, minimax_h3, qwen_image, qwen_image21, sd3, wan, zimage
from .base import JOINT, Family, Gather, ModulePlan, Split, Whole, block_lists, class_name, repeated_block_names

__all__ = [
    "JOINT", "Family", "FAMILIES", "INFERRED", "Gather", "ModulePlan", "Split", "Whole", "batch_args", "block_lists", "check_family", "class_name", "family_of", "family_of_class", "from_cp_plan", "module_plans", "repeated_block_names", "stream_of",
]


FAMILIES: dict[str, Family] = {
    "FluxTransformer2DModel": flux.FAMILY,
    "SD3Transformer2DModel": sd3.FAMILY,
    "QwenImageTransformer2DModel": qwen_image.FAMILY,
    "WanTransformer3DModel": wan.FAMILY,
    "ZImageTransformer2DModel": zimage.FAMILY,
    "HunyuanVideo15Transformer3DModel": hunyuanvideo15.FAMILY,
    "LTXVideoTransformer3DModel": ltx.FAMILY,
    "LTX2VideoTransformer3DModel": ltx2.FAMILY,
    "QwenImage21Transformer2DModel": qwen_image21.FAMILY,
    "ChromaTransformer2DModel": chroma.FAMILY,
    "MiniMaxH3Transformer3DModel": minimax_h3.FAMILY,
    # FLUX.2 and any other dispatcher-based class with a `_cp_plan` need no record.
}
"""Transformer class name -> its family; a class with a `_cp_plan` and no entry is generic."""


INFERRED = Family(
    infer=True,
    refuses={"stages": "its split plan is inferred from its whole forward at the first call, and a pipeline "
                       "stage holds part of it (write a plan, or use Ulysses, ring, CFG and batch groups)"},
)
"""The family of a class with no record and no `_cp_plan`: its plan inferred at its first call
(engine/plan_inference.py); a class whose attention bypasses the dispatcher is refused at `parallelize`."""


def family_of(transformer: torch.nn.Module) -> Family:
    """The family of `transformer`: its record, the generic family (a `_cp_plan`), or one whose
    plan is inferred from the model (`INFERRED`)."""
    name = class_name(transformer)
    if name in FAMILIES:
        return FAMILIES[name]
    if getattr(transformer, "_cp_plan", None):
        return Family()
    if not block_lists(transformer):
        raise UsageError(f"{name} cannot run sequence-parallel: it declares no _cp_plan, CoCoDiff has no plan for it, "
                         f"and none can be inferred: it has no list of blocks with attention of its own "
                         f"(supported: {', '.join(FAMILIES)}, any class with a _cp_plan, and any with such blocks)")
    return INFERRED


def family_of_class(name: str) -> Family:
    """The family of the diffusers transformer class `name`, known before it is built: its record,
    the generic family (a `_cp_plan`), or `INFERRED` (`family_of` refuses a class with no blocks to
    infer from once it is built)."""
    if name in FAMILIES:
        return FAMILIES[name]
    import diffusers

    return Family() if getattr(getattr(diffusers, name, None), "_cp_plan", None) else INFERRED


RUN_NEEDS = {"plan_trials": "--plan auto", "v_major": "--v-major", "step_cache": "--cache"}
"""What a run may ask of a family beside its plan (`Family.refuses` keys) -> the flag that asks it."""


def check_run_needs(transformer: torch.nn.Module, needs: set[str]) -> None:
    """Refuse in one line the first of `needs` (`RUN_NEEDS`' keys) that the family of `transformer`
    declares it cannot have; before anything is installed, alike on every rank."""
    family, name = family_of(transformer), class_name(transformer)
    for need in sorted(needs & family.refuses.keys() & RUN_NEEDS.keys()):
        raise UsageError(f"{RUN_NEEDS[need]}: {name} cannot have it: {family.refuses[need]}")


def check_family(transformer: torch.nn.Module, plan: Any, patches: bool = False) -> None:
    """Refuse in one line what the family of `transformer` declares it cannot have
    (`Family.refuses`) and `plan` asks for: CFG or batch groups ('data_groups'), pipeline stages
    ('stages'), a ring ('ring'), and with `patches` displaced patches ('patches')."""
    family, name = family_of(transformer), class_name(transformer)
    if not hasattr(plan, "cfg"):  # a plan still to choose
        return
    if plan.cfg * plan.batch > 1 and "data_groups" in family.refuses:
        raise UsageError(f"--plan {plan.short}: {name} cannot have CFG or batch groups: {family.refuses['data_groups']}")
    if plan.pipe > 1 and "stages" in family.refuses:
        raise UsageError(f"--plan {plan.short}: {name} cannot be cut in pipeline stages: {family.refuses['stages']}")
    if plan.ring > 1 and "ring" in family.refuses:
        raise UsageError(f"--plan {plan.short}: {name} cannot run on a ring: {family.refuses['ring']}")
    if patches and "patches" in family.refuses:
        raise UsageError(f"--pipe-patches: {name} cannot run in displaced patches: {family.refuses['patches']}")


def batch_args(family: Family, transformer: torch.nn.Module) -> tuple[str, ...]:
    """Forward arguments that carry the batch: the family's, else every forward argument (only a
    value whose leading dim is the call's batch is split; see engine/data_parallel.py)."""
    if family.batch_args is not None:
        return family.batch_args
    return tuple(inspect.signature(type(transformer).forward).parameters)[1:]


def module_plans(family: Family, transformer: torch.nn.Module) -> dict[str, ModulePlan] | None:
    """The family's plan, or the class's `_cp_plan` read as data; None: inferred at the first call."""
    if family.infer:
        return None
    if family.plan is not None:
        return family.plan
    plans = from_cp_plan(transformer._cp_plan, family.streams, type(transformer).__name__)
    for path, inputs in family.inputs.items():
        plan = plans.get(path, ModulePlan())
        plans[path] = ModulePlan(inputs={**plan.inputs, **inputs}, output=plan.output)
    return plans


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

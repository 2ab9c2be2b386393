"""The matrix's columns: every feature, declared once, as the flags a user would type.

A cell is a model (a row: every preset) and a feature (a column). Its expected outcome is
declared here, beside the feature, or beside the family (`Family.refuses`): **exact** (`verify`'s
tolerance against one process), **lossy** (PSNR against the exact run at or above the floor of
its lossy modes, `config/quality.py`, and what it saved), or **refused** (exit 2, one line, before
any rank loads weights). A new feature is one `Feature` line; a new preset or family enters every
column by itself.

An output that matches proves nothing of a feature that silently did nothing, so every column
also declares its evidence (`Feature.proves`): what in the cell's record shows the feature was in
effect (the plan that ran, the bytes of the axis it adds, each rank's weights, the graphs
compiled, the trials' choice...). A cell whose evidence is missing fails, whatever its output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FEATURES", "Feature", "IMAGE_TASKS", "LOSSY_MOVED", "animates", "cell_args", "cell_size", "missing_evidence", "needs_image",
           "node_bytes"]

EXACT, LOSSY = "exact", "lossy"

Record = dict[str, Any]
Evidence = Callable[[Record, dict[str, Record]], "str | None"]
"""(the cell's record, the records of the same model's other cells by column) -> None when the
feature shows in the record, else what is missing, in a few words."""

LOSSY_MOVED = 1e-5
"""The least relative difference of the latents from one process that a LOSSY cell must show, and
at least 4 times the largest of its model's exact cells (fp32 rounding: 2e-7 to 5e-5 by model; the
lossy modes land 20 to 10,000 times above it), so a lossy mode that changed nothing fails."""
LOSSY_LATENT_BOUND = 1.0
"""The most relative difference of the latents a LOSSY cell may show: off by their own scale is no
longer the same picture. It binds where the pictures' PSNR floors do not (random-weight VAEs
barely respond to latent error); on the trained preset, whose PSNR floors bind, five steps of a
step cache reach 0.75."""


def _axis_bytes(record: Record, axis: str) -> int:
    return sum((record.get("bytes_by_axis") or {}).get(axis, {}).values())


def node_bytes(record: Record) -> float:
    """Bytes per step that crossed the node level."""
    return float((record.get("bytes_by_level") or {}).get("node", 0))


def _holds(test: Callable[[Record], Any], missing: str) -> Evidence:
    """Evidence that `test(record)` holds (is truthy); else `missing`."""
    return lambda r, _: None if test(r) else missing


def _ran(plan: str) -> Evidence:
    return lambda r, _: None if r.get("plan") == plan else f"ran plan {r.get('plan')}, not {plan}"


def _made(count: int) -> Evidence:
    return lambda r, _: None if r.get("pictures") == count else f"{r.get('pictures')} pictures made, not {count}"


def _whole(others: dict[str, Record]) -> int | None:
    """The transformer's bytes on one rank of the default plan (the model whole)."""
    return (others.get("ulysses") or {}).get("transformer_param_bytes")


def _stages(r: Record, others: dict[str, Record]) -> str | None:
    """The stage boundary carried bytes, and each rank holds a part of the transformer, the parts
    together at least the whole (measured against the `ulysses` cell's whole transformer)."""
    held, whole = r.get("rank_param_bytes") or [], _whole(others)
    if not _axis_bytes(r, "stage"):
        return "no bytes crossed a stage boundary"
    if whole is not None and max(held) >= whole:
        return f"a rank holds {max(held)} bytes of the transformer, the whole of it ({whole})"
    if whole is not None and sum(held) < whole:
        return f"the ranks hold {sum(held)} bytes together, less than the transformer's {whole}"
    return None


def _sharded(against: str | None) -> Evidence:
    """Each rank holds about half of what the same plan holds unsharded (2 ranks share a copy)."""
    def check(r: Record, others: dict[str, Record]) -> str | None:
        if not r.get("shard_weights"):
            return "the weights were not sharded"
        base = others.get(against) if against else None
        whole = max(base["rank_param_bytes"]) if base and base.get("rank_param_bytes") else _whole(others)
        if whole is not None and max(r["rank_param_bytes"]) > 0.55 * whole:
            return f"a rank holds {max(r['rank_param_bytes'])} bytes, over half of {whole}"
        return None
    return check


_compiled = _holds(lambda r: r.get("compiled_graphs"), "torch.compile traced no graph")
_data_groups = _holds(lambda r: _axis_bytes(r, "cfg/batch"), "the data groups gathered nothing (each ran the whole batch)")
_ring = _holds(lambda r: sum((r.get("ring") or {}).get(k, 0) for k in ("same_node_bytes", "other_node_bytes")),
               "the ring passed no K/V")
_crosses_nodes = _holds(node_bytes, "nothing crossed the node level")
_vae_bands = _holds(lambda r: r.get("parallel_vae"), "the VAE decoded whole")
_patches = _holds(lambda r: r.get("patch_buffer_bytes"), "no displaced patch held K/V buffers")
_cache_skips = _holds(lambda r: (r.get("cache") or {}).get("skipped_steps"), "the cache skipped no step")


def _two_phase(r: Record, others: dict[str, Record]) -> str | None:
    exchange = r.get("exchange") or {}
    if exchange.get("name") != "tapa" or len(exchange.get("hops", [])) < 2:
        return f"the exchange ran {exchange.get('name')} with hops {exchange.get('hops')}, not two phases"
    return _crosses_nodes(r, others)


def _full_depth(r: Record, _others: dict[str, Record]) -> str | None:
    """Full-depth TAPA ran: a hop per level of more than one rank (inside one node: cards, then
    tiles; two-level TAPA would have been flat there), and each of them carried bytes."""
    exchange = r.get("exchange") or {}
    levels = [name for name, size in exchange.get("levels", []) if size > 1]
    idle = [name for name in levels if not (r.get("bytes_by_level") or {}).get(name)]
    if exchange.get("name") != "tapa-full" or len(exchange.get("hops", [])) != len(levels) or len(levels) < 2 or idle:
        return (f"the exchange ran {exchange.get('name')} with hops {exchange.get('hops')} over levels {levels}"
                f"{f', none over {idle}' if idle else ''}, not a hop per level")
    return None


def _trials(key: str, choose: bool) -> Evidence:
    """The trials timed every candidate and, with `choose`, chose one."""
    def check(r: Record, _others: dict[str, Record]) -> str | None:
        trials = r.get(key) or {}
        untimed = [c["name"] for c in trials.get("candidates", []) if c.get("step_ms") is None]
        if untimed or not trials.get("candidates"):
            return f"candidates never timed: {', '.join(untimed) or 'none listed'} ({trials.get('trial_steps')} trial steps)"
        if choose and trials.get("chosen") is None:
            return f"the trials made no choice ({trials.get('trial_steps')} trial steps)"
        return None
    return check


def _plan_trials(r: Record, others: dict[str, Record]) -> str | None:
    """Every candidate was timed, a stage per node among them where the model takes stages (its
    `stages` cell ran), and the plan chosen is the plan that ran. (Wan 2.2's first expert, whose
    trials these are, sees too few of the steps to finish their rounds.)"""
    trials = r.get("plan_trials") or {}
    names = [c["name"] for c in trials.get("candidates", [])]
    if (missing := _trials("plan_trials", choose=False)(r, others)) is not None:
        return missing
    if "stages" in others and not any(n.startswith("p") for n in names):
        return f"no stage plan among the candidates {names}"
    chosen = trials.get("chosen")
    return None if chosen in (None, r.get("plan")) else f"chose {chosen} but ran {r.get('plan')}"


def _offloaded(r: Record, _others: dict[str, Record]) -> str | None:
    resident = r.get("resident_text_encoders")
    return f"text encoders resident: {', '.join(resident)}" if resident else None


ENCODED_ONCE = ("QwenImageEditPlusPipeline", "QwenImageEditPipeline", "Flux2KleinPipeline")
"""Edit models whose inpainting encodes the image once (no masked image encoded apart; FLUX.1
Kontext's, as FLUX.1's, encodes both)."""


def _image_task(task: str, encodes: int) -> Evidence:
    """The run took the input, and encoded it in bands (`encodes` times: the family inpainting
    pipelines encode the masked image too; `ENCODED_ONCE`'s the image once) where its VAE decoded
    in bands."""
    def check(r: Record, _others: dict[str, Record]) -> str | None:
        from ..models.presets import pipeline_class

        given = (r.get("image_input") or {}).get("task")
        if given != task:
            return f"the run took no {task} input ({given})"
        expected = 1 if pipeline_class(r.get("model") or "") in ENCODED_ONCE else encodes
        if r.get("parallel_vae") and r.get("parallel_vae_encodes") != expected:
            return f"{r.get('parallel_vae_encodes')} encodes in bands, not {expected}"
        return None
    return check


def _edited(count: int) -> Evidence:
    """The run took `count` references as an edit, and their tokens joined the transformer's sequence."""
    def check(r: Record, _others: dict[str, Record]) -> str | None:
        given = r.get("image_input") or {}
        if given.get("task") != "edit" or len(given.get("references") or ()) != count:
            return f"the run took no {count} reference images ({given.get('task')}, {given.get('references')})"
        if not r.get("reference_tokens"):
            return "no reference tokens joined the transformer's sequence"
        return None
    return check


def _edits(model: str) -> str | None:
    """Why one --image is no edit for `model` (its cell of the edit column is n/a), or None: it is
    one (an edit model), or a refusal (a text-to-video model, refused by its kind)."""
    from ..engine.families.pipelines import EDIT_PIPELINES, UNROUTED_EDITS
    from ..models.presets import makes_video, pipeline_class

    pipeline = pipeline_class(model)
    if pipeline in EDIT_PIPELINES or pipeline in UNROUTED_EDITS or makes_video(model) and not animates(model):
        return None
    if animates(model):
        return f"{model} animates its one --image (every column of its row): it takes no reference images"
    return f"{pipeline} edits no reference images: its one --image is image-to-image (the img2img column)"


def _last_frame(r: Record, _others: dict[str, Record]) -> str | None:
    """The clip was conditioned on its last frame too: the transformer's input held the first and
    the last latent frame (beside the noise, or MiniMax-H3's rows of their own)."""
    from ..models.catalog import latent_frames
    from ..models.presets import PRESETS

    preset = PRESETS.get(r.get("model") or "")
    chunk = preset.frame_chunk if preset is not None else None
    frames, latent = r.get("conditioned_frames") or [], latent_frames(r.get("frames") or 1, 4, chunk)
    if frames != [0, latent - 1]:
        return f"the model was given latent frames {frames}, not the first and the last ({latent - 1})"
    return None


def _lora(r: Record, _others: dict[str, Record]) -> str | None:
    """The adapter was fused: layers of the transformer changed, and by how much."""
    fused = r.get("lora") or {}
    if not fused.get("layers") or not fused.get("weight_change"):
        return f"no weight changed by the adapter ({fused.get('layers', 0)} layers)"
    return None


def _quantized(r: Record, others: dict[str, Record]) -> str | None:
    """Linear layers were quantized, each rank holds the smaller weights, and against one process on
    the same quantized weights the run is exact (the verdict holds it to the weights as they come)."""
    quantized = r.get("quantize") or {}
    if not quantized.get("layers") or not quantized["quantized_bytes"] < quantized["weight_bytes"]:
        return f"no weight quantized ({quantized.get('layers', 0)} layers)"
    whole = _whole(others)
    if whole is not None and not r["transformer_param_bytes"] < whole:
        return f"a rank holds {r['transformer_param_bytes']} bytes of weights, no fewer than unquantized ({whole})"
    if not (r.get("same_weights") or {}).get("ok"):
        return "not exact against one process on the same quantized weights"
    return None


def _kernel(name: str) -> Evidence:
    def check(r: Record, _others: dict[str, Record]) -> str | None:
        """The attention ran on the backend's kernel, and on no other: `name` is its function's
        (`_native_attention` called directly by a hand-written processor, and its `_forward_op`
        handed to the exchange by the stock ones)."""
        ran = (r.get("attention_backend") or {}).get("kernels") or []
        return None if ran and all(k.removesuffix("_forward_op") == name for k in ran) else (
            f"the attention ran on {ran}, not {name}")
    return check


def _all(*checks: Evidence) -> Evidence:
    def check(r: Record, others: dict[str, Record]) -> str | None:
        return next((m for c in checks if (m := c(r, others)) is not None), None)
    return check


def missing_evidence(feature: "Feature", record: Record, others: dict[str, Record], unmoved: bool = False) -> str | None:
    """What a cell that ran lacks to show `feature` in effect (None: nothing): every rank took
    part, a LOSSY cell moved the output (and not too far; not asked of a model whose preset says
    why a lossy mode may leave it unmoved: `Preset.unmoved`), and the column's own evidence."""
    ranks = len(record.get("rank_param_bytes") or [])
    if ranks != feature.nproc:
        return f"{ranks} ranks reported, not {feature.nproc}"
    if feature.kind == LOSSY and not unmoved:
        moved = record.get("latent_rel_diff", 0.0)
        exact = [o["latent_rel_diff"] for o in others.values() if o.get("psnr_floor") is None and "latent_rel_diff" in o]
        least = max([LOSSY_MOVED, *(4 * e for e in exact)])
        if moved < least:
            return f"LOSSY, yet the latents are one process's (relative difference {moved:.1e}, under {least:.1e})"
        if moved > LOSSY_LATENT_BOUND:
            return f"the latents differ from one process's by {moved:.2f} (relative), over {LOSSY_LATENT_BOUND}"
    return feature.proves(record, others) if feature.proves is not None else None


@dataclass(frozen=True)
class Feature:
    name: str
    """The column's name (also `cocodiff matrix --features`)."""
    args: tuple[str, ...]
    """The flags of `verify` that turn it on, beside the cell's model, ranks and size."""
    nproc: int = 2
    ranks_per_node: int | None = None
    """Ranks per emulated node (2 of 4 ranks: two nodes, so the node level is crossed)."""
    kind: str = EXACT
    steps: int = 2
    """Denoising steps: 2, or more where the feature needs them to act (a step cache skips from the third)."""
    saves: str | None = None
    """What a LOSSY feature saves: 'steps' (the cache's skipped steps) or 'bytes' (inter-node bytes
    against the `baseline` column)."""
    baseline: str | None = None
    runs: int = 1
    """Runs of the cell in a row, the last one compared (magcache: the first calibrates its curve)."""
    needs: tuple[str, ...] = ()
    """What of a model it needs, which a family or preset may refuse (`models.presets.refusal`)."""
    refused: dict[str, str] = field(default_factory=dict)
    """model kind ('video', 'image') -> what the one-line refusal says, for features a kind cannot have."""
    proves: Evidence | None = None
    """What in a cell's record shows the feature was in effect (`missing_evidence`)."""
    applies: Callable[[str], "str | None"] | None = None
    """Why the column means nothing for a model (its cell is n/a, and nothing runs), or None: it
    does (a task its flags would run as another column's: one --image on an image model is img2img)."""


TAPA = ("--comm", "tapa")
ANIMATES = "animates one image: give it as --image (the clip's first frame), with no --mask or --strength"
"""What an image-to-video model's refusal of another image task says."""
_STAGES = _all(_ran("p2u1"), _stages)
FEATURES: tuple[Feature, ...] = (
    Feature("ulysses", (), nproc=4, proves=_ran("u4")),
    Feature("ring", ("--plan", "r2"), proves=_all(_ran("r2u1"), _ring)),
    Feature("ulysses x ring", ("--plan", "u2r2"), nproc=4, proves=_all(_ran("u2r2"), _ring)),
    # 4 steps: a run's first step is not paired into CFG groups (nor is each expert's, Wan 2.2).
    Feature("cfg groups", ("--plan", "c2u1"), steps=4, needs=("data_groups", "cfg"),
            proves=_all(_ran("c2u1"), _data_groups)),
    Feature("batch groups", ("--plan", "b2u1", "--batch", "2"), needs=("data_groups",),
            proves=_all(_ran("b2u1"), _made(2), _data_groups)),
    Feature("batch 2", ("--batch", "2"), proves=_all(_ran("u2"), _made(2))),
    Feature("stages", ("--plan", "p2", "--batch", "2"), needs=("stages",), proves=_all(_STAGES, _made(2))),
    Feature("stages x ulysses", ("--plan", "p2u2", "--batch", "2"), nproc=4, ranks_per_node=2,
            needs=("stages",), proves=_all(_ran("p2u2"), _made(2), _stages)),
    Feature("stages x cfg", ("--plan", "c2p2"), nproc=4, steps=4, needs=("data_groups", "stages", "cfg"),
            proves=_all(_ran("c2p2u1"), _stages, _data_groups)),
    Feature("stages x shard", ("--plan", "p2u2", "--shard-weights", "on"), nproc=4, ranks_per_node=2,
            needs=("stages",), proves=_all(_ran("p2u2"), _stages, _sharded("stages x ulysses"))),
    Feature("stages x compile", ("--plan", "p2", "--batch", "2", "--compile"), needs=("stages",),
            proves=_all(_STAGES, _compiled)),
    # Its gain is the stages computing at once, not bytes: the evidence is the patches' K/V buffers.
    Feature("displaced patches", ("--plan", "p2u2", "--pipe-patches", "2"), nproc=4, ranks_per_node=2, kind=LOSSY,
            steps=4, needs=("stages", "patches"), proves=_all(_ran("p2u2"), _stages, _patches)),
    Feature("tapa", (*TAPA, "--no-v-first"), nproc=4, ranks_per_node=2, proves=_two_phase),
    Feature("tapa+vfirst", (*TAPA, "--v-first"), nproc=4, ranks_per_node=2, proves=_two_phase),
    # Two levels inside a node: on two nodes of two ranks, full depth is two-level TAPA, which the tapa cells run.
    Feature("tapa-full", ("--comm", "tapa-full", "--levels", "node=1,card=2,tile=2"), nproc=4, proves=_full_depth),
    Feature("8 ranks", TAPA, nproc=8, ranks_per_node=4, proves=_crosses_nodes),
    # Steps for the trials to choose: a warm-up, 2 of each candidate, 3 more of each close one.
    Feature("comm auto", ("--comm", "auto"), nproc=4, ranks_per_node=2, steps=24, proves=_trials("exchange", choose=True)),
    Feature("plan auto", ("--plan", "auto"), nproc=4, ranks_per_node=2, steps=24, needs=("plan_trials",),
            proves=_plan_trials),
    Feature("v-major v", (*TAPA, "--v-major", "linear"), nproc=4, ranks_per_node=2, kind=LOSSY, steps=4,
            needs=("v_major",), saves="bytes", baseline="tapa+vfirst", proves=_two_phase),
    Feature("v-major vqk", (*TAPA, "--v-major", "linear", "--v-major-tensors", "vqk"), nproc=4, ranks_per_node=2,
            kind=LOSSY, steps=4, needs=("v_major",), saves="bytes", baseline="tapa+vfirst", proves=_two_phase),
    Feature("wire fp8", (*TAPA, "--wire", "node=fp8"), nproc=4, ranks_per_node=2, kind=LOSSY, saves="bytes",
            baseline="tapa+vfirst", proves=_two_phase),
    Feature("wire int8", (*TAPA, "--wire", "node=int8"), nproc=4, ranks_per_node=2, kind=LOSSY, saves="bytes",
            baseline="tapa+vfirst", proves=_two_phase),
    *(Feature(spec.split(":")[0], ("--cache", spec), kind=LOSSY, steps=5, saves="steps", runs=1 + spec.startswith("mag"),
              needs=("step_cache",), proves=_cache_skips)
      for spec in ("fbcache:1e9", "dbcache:F1B0W1,1e9", "teacache:W1,0.5", "magcache:W1,0.5", "taylorseer:F1B0N2O1W1")),
    Feature("shard weights", ("--shard-weights", "on"), ranks_per_node=2, proves=_all(_ran("u2"), _sharded(None))),
    Feature("offload encoders", ("--offload-text-encoders", "on"), proves=_offloaded),
    Feature("parallel vae", ("--parallel-vae", "on"), needs=("parallel_vae",), proves=_vae_bands),
    Feature("compile", ("--compile",), proves=_compiled),
    Feature("lora", ("--lora", "{lora}:0.8"), needs=("lora",), proves=_lora),
    Feature("quantize int8", ("--quantize", "int8wo"), kind=LOSSY, proves=_quantized),
    Feature("fp8 storage", ("--quantize", "float8storage"), kind=LOSSY, proves=_quantized),
    Feature("attention native", ("--attention-backend", "native"), proves=_kernel("_native_attention")),
    Feature("attention math", ("--attention-backend", "_native_math"), needs=("split_kernel",),
            proves=_kernel("_native_math_attention")),
    Feature("img2img", ("--image", "{image}", "--strength", "0.6"), needs=("image_input",),
            refused={"video": "is a text-to-video model here; image input is for image models", "i2v": ANIMATES},
            proves=_image_task("img2img", 1)),
    Feature("inpaint", ("--image", "{image}", "--mask", "{mask}"), needs=("image_input", "mask"),
            refused={"video": "is a text-to-video model here; image input is for image models", "i2v": ANIMATES},
            proves=_image_task("inpaint", 2)),
    Feature("last frame", ("--last-frame", "{image2}"), needs=("last_frame",), proves=_last_frame),
    Feature("edit 1 ref", ("--image", "{image}"), applies=_edits, needs=("edit",),
            refused={"video": "is a text-to-video model here; image input is for image models"}, proves=_edited(1)),
    Feature("edit 2 refs", ("--image", "{image}", "--image", "{image2}"), needs=("references", "edit"),
            refused={"video": "is a text-to-video model here; image input is for image models", "i2v": ANIMATES},
            proves=_edited(2)),
)
"""The columns, in the order docs/matrix.md shows them."""

IMAGE_TASKS = ("img2img", "inpaint")


def cell_size(pixel_multiple: int, video: bool, animate: bool = False,
              shortest: int | None = None) -> tuple[int, int, int | None]:
    """(height, width, frames) of a cell: the smallest picture that gives every rank of 4 tokens
    and VAE rows of its own (64 px, or four of the model's pixel multiples), 5 frames of a clip; 9
    of a clip animated from an image, whose first latent frame is the image, the same at every
    step (5 frames would leave one latent frame to denoise, and displaced patches nothing to move:
    LTX-Video's output moved 4e-05 at 5 frames, 1e-03 at 9); a model's `shortest` clip where it
    makes none shorter (MiniMax-H3: 124 frames, 5 seconds)."""
    side = max(64, 4 * pixel_multiple)
    return side, side, max((9 if animate else 5), shortest or 0) if video else None


def cell_args(model: str, feature: Feature, size: tuple[int, int, int | None], files: dict[str, str]) -> list[str]:
    """`verify`'s command line for one cell (after `verify`)."""
    from ..models.presets import last_frame_of

    height, width, frames = size
    args = ["--model", model, "--nproc", str(feature.nproc), "--steps", str(feature.steps),
            "--height", str(height), "--width", str(width), "--seed", "0"]
    if frames is not None:
        args += ["--frames", str(frames)]
    if feature.ranks_per_node is not None:
        args += ["--ranks-per-node", str(feature.ranks_per_node)]
    given = [a.format(**files) for a in feature.args]  # the cell's files by name
    if needs_image(model) and "--image" not in given:  # every column of an image-to-video model animates the
        given += ["--image", files["image"]]  # image; of an edit model that needs one, edits it
    if last_frame_of(model) == "required" and "--last-frame" not in given:  # and of a first-last-frame model,
        given += ["--last-frame", files["image2"]]  # to its last frame
    return args + given


def animates(model: str) -> bool:
    """Whether `model` is an image-to-video model: every run takes an image (its clip's first frame)."""
    from ..engine.families.pipelines import ANIMATE_PIPELINES
    from ..models.presets import pipeline_class

    return pipeline_class(model) in ANIMATE_PIPELINES


def needs_image(model: str) -> bool:
    """Whether every run of `model` takes an image: an image-to-video model's first frame, or the
    reference of an edit model that makes nothing from text alone (Qwen-Image-Edit)."""
    from ..engine.families.pipelines import NEEDS_REFERENCE
    from ..models.presets import pipeline_class

    return animates(model) or pipeline_class(model) in NEEDS_REFERENCE

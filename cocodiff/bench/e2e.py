"""`cocodiff bench e2e`: end-to-end latency per denoising step of several variants, in one launch.

Variants are named in the grammar of cocodiff/config/variants.py: an exchange (`flat`, `tapa`, `auto`)
and options (`+vfirst`, `+vmajor`, `+vmajorqk`), or diffusers' own Ulysses. `flat` alone is the paper's baseline: one flat all-to-all per tensor, V, Q and K sent
after all three are computed. The variants run alternately (A B C A B C ...) on the same ranks,
pipeline and inputs, after one untimed warm-up run each; medians are over all timed steps.

V-First's report, per attention layer: T_comm(V) is V's exchange time in the matching variant
without V-First (where it is fully exposed), T_compute(Q,K) the Q/K projection, norm and RoPE
time V overlaps, overlap = min(T_comm(V), T_compute(Q,K)) what the paper's model expects V-First
to hide, and hidden = the input exchanges' exposed wait without V-First minus the wait with it.
Hidden is measured and counts every wait V-First removes, so it is not bounded by the overlap
(with TAPA, V's inter-node phase also runs under Q/K's intra-node phase). The paper's condition
T_comm(V) <= T_compute(Q,K) says whether V can be hidden entirely.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.comm import Exchange, make_exchange, transport
from ..distributed.comm.stats import LINKS, add_axes
from ..config.parallel import ParallelConfig
from ..distributed.memory import peak_bytes, reset_peak, runtime_bytes
from ..engine.attention.backends import resolve_backend, set_backend
from ..engine.attention.core import resolve_timeline
from ..engine.parallelize import attention_heads, parallelize, resolve_plan
from ..config.plan import AUTO, parse_plan
from ..engine.plan_trials import PlanTrials, build_plan_trials
from ..models.presets import pipeline_inputs
from ..engine.families.pipelines import uses_cfg
from ..run.pipeline import run_pipeline
from ..run.summary import memory_figures
from ..run.load import load
from ..run.spec import GenerateSpec
from ..engine.shard import local_parameter_bytes
from ..distributed.topology import PlanGroups, Topology
from ..config.variants import BASELINES, DIFFUSERS_ULYSSES, XDIT_ULYSSES, Variant
from .a2a import run_header
from .diffusers_cp import DiffusersUlysses, check_supported
from .xdit import XDiTUlysses
from .xdit import check_supported as check_xdit

__all__ = ["E2ESpec", "e2e_job", "variant_config"]


def variant_config(variant: Variant, ranks_per_node: int | None, shard_weights: bool | str = False) -> ParallelConfig:
    """The engine's configuration of one of cocodiff's own variants (not the baseline); the
    weights sharded as the run's `--shard-weights` resolved, or by the variant's `+shard`."""
    v_first = variant.v_first or (None if variant.comm == "auto" else False)  # plain `auto` decides V-First
    return ParallelConfig(comm=variant.comm, ranks_per_node=ranks_per_node, v_first=v_first,
                          v_major=variant.v_major, v_major_tensors=variant.v_major_tensors or "v", plan=variant.plan,
                          compile=variant.compile, cache=variant.cache, wire=variant.wire,
                          shard_weights=(shard_weights is True or variant.shard) and not variant.compile,
                          pipe_patches=variant.patches, attention_backend=variant.attention)


def _comm(variant: Variant) -> str:
    """What decides a variant's exchange: its comm, and for `auto` whether V-First is fixed too."""
    return variant.comm + ("+vfirst" if variant.comm == "auto" and variant.v_first else "")


@dataclass(kw_only=True)
class E2ESpec:
    generate: GenerateSpec
    variants: list[Variant]
    repeat: int = 3


def _stages(variant: Variant) -> int:
    """The pipeline stages of `variant`'s plan (1: none)."""
    return parse_plan(variant.plan).pipe if variant.plan not in (None, AUTO) else 1


def _staged_spec(gen: GenerateSpec, variant: Variant) -> GenerateSpec:
    """`gen` for the copy of the pipeline a stage variant runs on: loaded as `generate --plan` loads
    it (run/load.py: the transformer on the host, its size checked for the variant's stage), its
    weights quantized as the variant's are."""
    shard = variant_config(variant, gen.parallel.ranks_per_node, gen.parallel.shard_weights).shard_weights  # as the variant runs
    return replace(gen, parallel=replace(gen.parallel, plan=parse_plan(variant.plan), shard_weights=shard),
                   quantize=variant.quantize)


def _plain_key(variant: Variant) -> tuple:
    """The copy of the pipeline a variant without stages runs on: one per `+shard` (sharded for
    good) and per `+quantize` mode (quantized for good); () the first, as loaded."""
    if variant.quantize is not None:
        return ("quantized", variant.quantize)
    return ("sharded",) if variant.shard else ()


def _staged_key(variant: Variant) -> tuple:
    """The copy a stage plan runs on (cut for its stage for good): one per plan, `+shard` and
    `+quantize`; `--plan auto`'s, made only when its trials hold a stage plan."""
    return ("staged", variant.plan, variant.shard, variant.quantize)


def _copy(copies: dict[tuple, Any], variant: Variant) -> Any:
    """The copy of the pipeline `variant` runs on (`_plain_key`, `_staged_key`)."""
    staged = copies.get(_staged_key(variant))
    return staged if staged is not None else copies[_plain_key(variant)]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _layer_medians(timeline: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        layer: {key: _median([call[key] for call in calls]) for key in calls[0]}
        for layer, calls in timeline.items()
        if calls
    }


def e2e_job(spec: E2ESpec) -> dict[str, Any] | None:
    gen = spec.generate
    pipe, encoder = load(gen)
    copies: dict[tuple, Any] = {(): pipe}  # `_plain_key` or `_staged_key` -> a copy of the pipeline
    quantized: dict[str, dict[str, Any]] = {}  # per `+quantize` mode: what quantizing did (models/quantize.py)
    for v in spec.variants:
        key = _staged_key(v) if _stages(v) > 1 else _plain_key(v)
        if key in copies or v.baseline:
            continue
        if key == ("sharded",) and gen.parallel.shard_weights is True:
            copies[key] = pipe  # every variant's weights sharded already
            continue
        # `+shard`: FSDP2 shards for good (it has no undo); a stage plan's copy is cut for its stage for good
        # (its blocks go), loaded on the host: its stage's part goes to the device once cut (engine/parallelize.py
        # `_cut`); `+quantize`: quantized for good.
        own = _staged_spec(gen, v) if _stages(v) > 1 else replace(gen, quantize=v.quantize)
        copies[key] = load(own)[0]
        if own.quantized is not None:
            quantized[v.quantize] = own.quantized
    topology = Topology.from_env(gen.parallel.ranks_per_node)
    distinct = list({id(c): c for c in copies.values()}.values())  # a copy may stand for several keys
    runtime = runtime_bytes(*distinct, encoder=encoder)  # the CPU's resident set besides the weights
    groups: dict[Variant, PlanGroups] = {}  # per variant, its plan's groups, built once per plan
    exchanges: dict[tuple[str, str], Exchange] = {}  # per (plan, comm), built once (`auto`: its trials hold across runs)
    trials: dict[str, PlanTrials] = {}  # per comm of `auto` plan variants: the plans timed on the first steps
    tokens = _token_counts(pipe, encoder, gen) if any(v.baseline for v in spec.variants) else {}
    for v in spec.variants:
        if v.comm == DIFFUSERS_ULYSSES:
            check_supported(pipe.transformer, tokens, topology.world_size)
        if v.comm == XDIT_ULYSSES:
            check_xdit(pipe.transformer, topology.world_size)
        if v.baseline:
            continue
        if v.plan == AUTO and _comm(v) not in trials:
            built = build_plan_trials(variant_config(v, gen.parallel.ranks_per_node), topology, attention_heads(pipe.transformer),
                                      uses_cfg(pipe), gen.batch, pipe.transformer)
            if built is not None:
                trials[_comm(v)] = built
            if built is not None and any(g.plan.pipe > 1 for g, _ in built.options.values()):
                copies[_staged_key(v)] = load(replace(gen, quantize=v.quantize))[0]  # a stage plan chosen keeps its cut: a copy of its own
        if v.plan == AUTO and _comm(v) in trials:
            continue  # its candidates' groups and exchanges are the trials'
        plan = resolve_plan(pipe, variant_config(v, gen.parallel.ranks_per_node), topology, images=gen.batch)
        known = {g.plan: g for g in groups.values()}
        groups[v] = known.get(plan) or topology.split(plan)
        if (plan.short, _comm(v)) not in exchanges:
            exchanges[plan.short, _comm(v)] = make_exchange(v.comm, groups[v].ulysses, None, v_first=variant_config(v, None).v_first)
    samples: dict[str, dict[str, Any]] = {v.name: {"step_s": [], "runs": [], "peak_bytes": 0, "param_bytes": 0}
                                          for v in spec.variants}
    images: dict[str, torch.Tensor] = {}
    for rep in range(spec.repeat + 1):  # rep 0 warms every variant up, untimed
        for v in spec.variants:
            if v.baseline:
                parallel = DiffusersUlysses(pipe.transformer, topology) if v.comm == DIFFUSERS_ULYSSES else \
                    XDiTUlysses(pipe, topology, tokens.get("text", 0))
                timeline = parallel.timeline
            else:
                config = variant_config(v, gen.parallel.ranks_per_node, gen.parallel.shard_weights)
                own = _copy(copies, v)
                set_backend(own, resolve_backend(v.attention))  # the stock processors' (None: the default)
                if v.plan == AUTO and _comm(v) in trials:
                    parallel = parallelize(own, config, topology, plan_trials=trials[_comm(v)])
                else:
                    parallel = parallelize(own, config, topology, exchange=exchanges[groups[v].plan.short, _comm(v)], groups=groups[v])
                timeline = {}
                if not v.compile:  # per-layer marks read the clock: in a compiled block, a graph break each
                    parallel.ctx.timeline = timeline
            reset_peak(topology.device)  # each variant's own peak (the CPU's from what the process holds now)
            run = run_pipeline(replace(gen), pipe if v.baseline else own, encoder, parallel)
            samples[v.name]["peak_bytes"] = max(samples[v.name]["peak_bytes"], peak_bytes(topology.device))
            samples[v.name]["param_bytes"] = local_parameter_bytes((pipe if v.baseline else own).transformer)
            parallel.undo()
            if rep == 0:
                images[v.name] = torch.from_numpy(run["image"])
                continue
            totals = parallel.stats.totals()
            samples[v.name]["step_s"] += run["step_s"]
            samples[v.name]["runs"].append(
                {
                    "totals": totals,
                    "proj_other_node_bytes": parallel.stats.other_node_bytes["a2a_in"],
                    "by_axis": parallel.stats.by_axis(),
                    "wait_by_kind_s": dict(parallel.stats.wait_s),
                    "ring_in_flight_s": getattr(parallel.stats, "in_flight_s", {}).get("ring", 0.0),
                    "elapsed_s": sum(run["step_s"]),
                    "layers": _layer_medians(resolve_timeline(timeline, topology.device)),
                    "kernels": sorted(parallel.ctx.kernels) if not v.baseline else [],
                }
            )
    estimated = {}  # a variant's pipeline as footprint counts it, beside the other copies' idle transformers
    for v in spec.variants:
        own = pipe if v.baseline else _copy(copies, v)
        idle = sum(local_parameter_bytes(c.transformer) for c in distinct if c is not own)
        estimated[v.name] = memory_figures(gen, own, encoder, 0, runtime)["estimated_bytes"] + idle
    local = {name: {**_summarize(s, gen.steps), "peak_bytes": s["peak_bytes"], "param_bytes": s["param_bytes"],
                    "estimated_bytes": estimated[name]}
             for name, s in samples.items()}
    everyone: list[Any] = [None] * topology.world_size
    dist.all_gather_object(everyone, local, group=topology.world_group)
    if topology.rank != 0:
        return None
    timed = {}  # `auto` plan variants: what their trial steps measured, and the plan they ran after
    for v in spec.variants:
        if v.plan == AUTO and _comm(v) in trials:
            timed[v.name] = trials[_comm(v)]
            groups[v] = timed[v.name].current[0]
    chosen = {v.name: timed[v.name].report() if v.name in timed else exchanges[groups[v].plan.short, _comm(v)].report()
              for v in spec.variants if v.comm == "auto"}
    return _report(spec, topology, everyone, images, groups, chosen, timed, quantized)


def _token_counts(pipe: Any, encoder: Any, gen: GenerateSpec) -> dict[str, int]:
    """Image and text tokens of one transformer call (FLUX-style 2x2 packing of the latents; an
    edit's reference images join the image tokens)."""
    inputs = pipeline_inputs(pipe, encoder, gen.prompt, model=gen.model)
    pixels_per_token = 2 * pipe.vae_scale_factor
    sizes = [(gen.height, gen.width), *(image.shape[:2] for image in gen.source.images)] if gen.source and gen.source.edit \
        else [(gen.height, gen.width)]
    tokens = {"image": sum((h // pixels_per_token) * (w // pixels_per_token) for h, w in sizes)}
    if "prompt_embeds" in inputs:
        tokens["text"] = inputs["prompt_embeds"].shape[1]
    return tokens


def _summarize(samples: dict[str, list], steps: int) -> dict[str, Any]:
    """This rank's figures for one variant: per-step traffic and waits, per-layer timings."""
    runs = samples["runs"]
    layers: dict[str, dict[str, float]] = {}
    for layer in runs[0]["layers"]:
        keys = runs[0]["layers"][layer]
        layers[layer] = {k: _median([r["layers"][layer][k] for r in runs]) for k in keys}
    return {
        "step_s": samples["step_s"],
        "same_node_bytes": _median([r["totals"]["same_node_bytes"] / steps for r in runs]),
        "proj_other_node_bytes": _median([r["proj_other_node_bytes"] / steps for r in runs]),
        "other_node_bytes": _median([r["totals"]["other_node_bytes"] / steps for r in runs]),
        "wait_s": _median([r["totals"]["wait_s"] / steps for r in runs]),
        "wait_by_kind_s": {
            kind: _median([r["wait_by_kind_s"].get(kind, 0.0) / steps for r in runs])
            for kind in sorted({k for r in runs for k in r["wait_by_kind_s"]})
        },
        "ring_in_flight_s": _median([r["ring_in_flight_s"] / steps for r in runs]),
        "by_axis": {
            axis: {link: _median([r["by_axis"].get(axis, {}).get(link, 0) / steps for r in runs]) for link in LINKS}
            for axis in sorted({a for r in runs for a in r["by_axis"]})
        },
        "layers": layers,
        "kernels": sorted({k for r in runs for k in r["kernels"]}),  # the attention's functions (backends.kernel_name)
    }


def _report(
    spec: E2ESpec, topology: Topology, ranks: list[dict], images: dict[str, torch.Tensor], groups: dict[Variant, PlanGroups],
    chosen: dict[str, dict[str, Any]], timed: dict[str, PlanTrials], quantized: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    gen = spec.generate
    variants: dict[str, dict[str, Any]] = {}
    for v in spec.variants:
        per_rank = [r[v.name] for r in ranks]
        # A step ends when the slowest rank ends it. Plans whose ranks trade data every step keep
        # them in lockstep; a plan with no exchange in a step (replicas: a call with fewer items
        # than the data groups) lets them drift, and any one rank's times would flatter it.
        step_s = [max(steps) for steps in zip(*(r["step_s"] for r in per_rank))]
        step_ms = _median(step_s) * 1e3
        # Waits are totals per run over its steps: their shares are of the mean step, the same statistic.
        step_ms_mean = statistics.mean(step_s) * 1e3
        variants[v.name] = {
            "comm": v.comm,
            "plan": groups[v].plan.short if v in groups else f"u{topology.world_size}",
            "plan_description": groups[v].plan.describe() if v in groups else "diffusers' Ulysses over every rank",
            "v_first": v.v_first,
            "step_ms": step_ms,
            "step_ms_mean": step_ms_mean,
            "lossy": v.inexact,
            "cache": v.cache,  # a step cache's spec (LOSSY), None without
            "wire": v.wire,  # wire formats per level (LOSSY; `slowest=fp8` for +fp8), None without
            "quantize": quantized.get(v.quantize),  # LOSSY: the mode, layers and weight bytes; None without
            "attention_backend": {"name": v.attention,  # None: the default; the kernels every rank ran
                                  "kernels": sorted({k for r in per_rank for k in r["kernels"]})},
            "inter_node_bytes": int(sum(r["other_node_bytes"] for r in per_rank)),
            "inter_node_projection_bytes": int(sum(r["proj_other_node_bytes"] for r in per_rank)),
            "intra_node_bytes": int(sum(r["same_node_bytes"] for r in per_rank)),
            "bytes_by_axis": {  # per step, all ranks: which axis of the plan sends what over which links
                axis: {link: int(n) for link, n in links.items()}
                for axis, links in add_axes([r["by_axis"] for r in per_rank]).items()
            },
            "exposed_comm_ms": statistics.mean(r["wait_s"] for r in per_rank) * 1e3,
            "exposed_comm_ms_by_kind": {
                kind: statistics.mean(r["wait_by_kind_s"].get(kind, 0.0) for r in per_rank) * 1e3
                for kind in sorted({k for r in per_rank for k in r["wait_by_kind_s"]})
            },
            "max_abs_diff_vs_first": (images[v.name] - images[spec.variants[0].name]).abs().max().item(),
            "peak_bytes": max(r["peak_bytes"] for r in per_rank),  # measured per rank (footprint.peak_bytes)
            "estimated_bytes": max(r["estimated_bytes"] for r in per_rank),
            "shard_weights": v.shard or gen.parallel.shard_weights is True,  # FSDP2 over each node's ranks
            "transformer_param_bytes": max(r["param_bytes"] for r in per_rank),  # one rank's, sharded or whole
        }
        if v.name in chosen:  # `auto`: what its trial steps measured and chose
            variants[v.name]["auto_choice"] = chosen[v.name]
        if v.name in timed:  # `--plan auto`: the plans its trial steps measured, the one chosen
            variants[v.name]["plan_trials"] = timed[v.name].report()
            variants[v.name]["plan_description"] = timed[v.name].plan.describe()
        in_flight = sum(r["ring_in_flight_s"] for r in per_rank)
        if in_flight > 0:  # ring attention: the share of its blocks' time in flight no rank waited for
            exposed = sum(r["wait_by_kind_s"].get("ring", 0.0) for r in per_rank)
            variants[v.name]["ring_hidden_share"] = 1 - exposed / in_flight
    baseline = variants.get("flat") or variants[spec.variants[0].name]
    for figures in variants.values():
        figures["speedup_vs_flat"] = baseline["step_ms"] / figures["step_ms"]
        # Per image: mean steps. A step cache makes steps bimodal (skipped ones are fast), and the
        # median step of a run that skips most steps is a skipped one, which flatters it.
        figures["image_ms"] = figures["step_ms_mean"] * gen.steps
        figures["speedup_per_image_vs_flat"] = baseline["step_ms_mean"] / figures["step_ms_mean"]
        figures["comm_share"] = figures["exposed_comm_ms"] / figures["step_ms_mean"]
    fixed = [v.name for v in spec.variants if v.comm != "auto" and v.plan != AUTO and not (v.inexact or v.baseline)]
    if fixed:  # how far each `auto` variant is from the fastest variant that fixes its choices
        best = min(fixed, key=lambda name: variants[name]["step_ms"])
        for v in spec.variants:
            if v.comm == "auto" or v.plan == AUTO:
                variants[v.name]["vs_fastest_fixed"] = {
                    "variant": best, "ratio": variants[v.name]["step_ms"] / variants[best]["step_ms"]}
    for comm, peer in BASELINES.items():
        theirs = next((v.name for v in spec.variants if v.comm == comm), None)
        if theirs is not None:
            for name, figures in variants.items():
                figures[f"speedup_vs_{peer}"] = variants[theirs]["step_ms"] / figures["step_ms"]
                figures[f"max_abs_diff_vs_{peer}"] = (images[name] - images[theirs]).abs().max().item()
    return {
        **run_header(gen, topology),
        "batch": gen.batch,
        "image_input": gen.source.report() if gen.source is not None else None,  # an edit's references, ...
        "dtype": gen.dtype,  # resolved by load(): the weights' and activations' dtype
        "repeat": spec.repeat,
        "threads_per_rank": torch.get_num_threads(),
        "transport": transport(dist.get_backend()),
        "baseline": "flat" if "flat" in variants else spec.variants[0].name,
        "variants": variants,
        "v_first": _v_first_report(spec.variants, ranks, groups),
    }


def _v_first_report(variants: list[Variant], ranks: list[dict], groups: dict[Variant, PlanGroups]) -> dict[str, Any]:
    """Per V-First variant and layer (means over ranks of per-layer medians).

    T_comm(V): V's exchange alone, from the variant without V-First. T_compute(Q,K): the work V
    overlaps. exposed: time blocked on the V, Q and K exchanges after Q and K are ready, in each
    order; hidden = exposed without V-First - exposed with it. overlap = min(T_comm(V),
    T_compute(Q,K)), what the paper's model expects V-First to hide: a model, not a bound on the
    measured hidden time, which counts every wait V-First removes (with TAPA, V's inter-node
    phase also runs under Q/K's intra-node phase).
    """
    report = {}

    def base(v: Variant) -> tuple[str | None, str]:
        """What a V-First variant is compared with: the same plan (as run), exchange and kernel."""
        return (groups[v].plan.short if v in groups else None, v.comm, v.attention)

    plain = {base(v): v.name for v in variants if not v.v_first and not v.inexact}
    for v in variants:
        if not v.v_first or v.inexact or base(v) not in plain:
            continue
        against = plain[base(v)]
        rows = []
        for layer in ranks[0][v.name]["layers"]:
            def mean(variant: str, key: str, layer: str = layer) -> float:
                return statistics.mean(r[variant]["layers"][layer][key] for r in ranks)

            t_comm_v, t_qk = mean(against, "v_comm_ms"), mean(v.name, "qk_compute_ms")
            exposed_plain, exposed = mean(against, "input_exposed_ms"), mean(v.name, "input_exposed_ms")
            overlap, hidden = min(t_comm_v, t_qk), exposed_plain - exposed
            rows.append(
                {
                    "layer": layer,
                    "t_comm_v_ms": t_comm_v,
                    "t_compute_qk_ms": t_qk,
                    "exposed_without_ms": exposed_plain,
                    "exposed_with_ms": exposed,
                    "overlap_ms": overlap,
                    "hidden_ms": hidden,
                    "hidden_over_overlap": hidden / overlap if overlap > 0 else 0.0,
                    "condition_holds": t_comm_v <= t_qk,
                }
            )
        total_overlap = sum(r["overlap_ms"] for r in rows)
        report[v.name] = {
            "against": against,
            "layers": rows,
            "hidden_ms": sum(r["hidden_ms"] for r in rows),
            "overlap_ms": total_overlap,
            "hidden_over_overlap": sum(r["hidden_ms"] for r in rows) / total_overlap if total_overlap else 0.0,
            "t_comm_v_ms": sum(r["t_comm_v_ms"] for r in rows),
            "layers_meeting_condition": sum(r["condition_holds"] for r in rows),
        }
    return report

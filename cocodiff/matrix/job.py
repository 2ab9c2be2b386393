"""What each rank runs for the matrix: one model's cells of one world size, in a row.

Every cell is `verify`'s run (`run.jobs`): a fresh pipeline, `parallelize` with the cell's
config, the pipeline call, the undo. Rank 0 compares each with the one-process run of the same
request, computed once per request and kept in the run's folder, for the launches after this
one too. Each finished cell's record is written at once to its own file, so a cell that fails
leaves the ones before it read, and the runner starts the rest anew.

Beside the run's own record, a cell keeps what shows its feature was in effect
(`matrix.cells`): every rank's transformer bytes, the graphs `--compile` traced, and where the
text encoders are.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.parallel import ParallelConfig
from ..engine.offload import text_encoders
from ..engine.shard import local_parameter_bytes
from ..run.jobs import compare, generate_run, whole_pipeline
from ..run.pipeline import is_rank0, run_pipeline
from ..run.spec import GenerateSpec

__all__ = ["matrix_job"]

KEPT = ("model", "plan", "plan_description", "inferred_plan", "comm", "exchange", "cache", "wire", "v_major", "bytes_by_level", "bytes_by_axis",
        "ring", "shard_weights", "offload_text_encoders", "parallel_vae", "parallel_vae_encodes", "image_input", "reference_tokens", "conditioned_frames",
        "compile", "lora", "quantize", "attention_backend", "transformer_param_bytes", "patch_buffer_bytes", "auto_choice", "plan_trials", "steps", "frames")
"""What a cell's record keeps of the run's own (the rest is the comparison)."""


def _request(spec: GenerateSpec, quantized: bool) -> tuple:
    """What the one-process reference depends on: the request, not how it is run (and the
    quantized weights, for a reference on the same weights)."""
    source = spec.source.report() if spec.source is not None else None
    return (spec.model, spec.steps, spec.height, spec.width, spec.frames, spec.batch, spec.seed, spec.dtype,
            json.dumps(source, sort_keys=True), tuple((a.path, a.scale) for a in spec.lora),
            *([spec.quantize] if quantized else []))


def _reference(spec: GenerateSpec, quantized: bool) -> dict[str, Any]:
    """The stock pipeline's run of the same request in this process alone, on the weights as
    they come (or `quantized` as the run's)."""
    alone = dataclasses.replace(spec, parallel=ParallelConfig())
    return run_pipeline(alone, *whole_pipeline(alone, quantize=quantized), None)


def _evidence(pipe: Any, encoder: Any) -> dict[str, Any]:
    """What the run's record does not say of its features: each rank's transformer bytes (stages,
    shards), the graphs torch.compile traced in this cell, the text encoders left resident."""
    from diffusers.hooks.group_offloading import _is_group_offload_enabled
    from torch._dynamo.utils import counters

    held = local_parameter_bytes(pipe.transformer)
    ranks: list[Any] = [held]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, held)
    resident = [name for name, module in text_encoders(pipe, encoder).items()
                if not _is_group_offload_enabled(module) and any(p.device.type != "meta" for p in module.parameters())]
    return {"rank_param_bytes": ranks, "compiled_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": sum(counters["graph_break"].values()), "resident_text_encoders": resident}


def _reference_of(spec: GenerateSpec, folder: Path, quantized: bool = False) -> dict[str, Any]:
    """The one-process run of `spec`'s request: computed once in a matrix run, kept in `folder`."""
    path = folder / f"{hashlib.sha256(repr(_request(spec, quantized)).encode()).hexdigest()[:16]}.pt"
    if path.is_file():
        return torch.load(path, weights_only=False)
    reference = _reference(spec, quantized)
    scratch = path.with_suffix(".part")
    torch.save(reference, scratch)
    scratch.rename(path)
    return reference


def matrix_job(cells: list[tuple[str, GenerateSpec, int]], out_dir: Path, references: Path) -> None:
    """Run `cells` ((name, spec, runs)) in order; rank 0 writes `<name>.json` for each, and keeps
    the one-process references in `references`."""
    from diffusers import DiffusionPipeline
    from torch._dynamo.utils import counters

    # No progress bars in the ranks: the runner reports per launch. A class default, read by every
    # pipeline this rank builds that sets none of its own (diffusers' `progress_bar`).
    DiffusionPipeline._progress_bar_config = {"disable": True}
    for name, spec, runs in cells:
        began = time.perf_counter()
        torch._dynamo.reset()  # a cell compiles afresh, as in a process of its own (no recompile limit across cells)
        counters.clear()
        for _ in range(runs):  # the last run counts (an earlier one calibrates: magcache)
            result, parallel, pipe, encoder = generate_run(dataclasses.replace(spec))
            evidence = _evidence(pipe, encoder)
            if parallel is not None:
                parallel.undo()
                parallel.release_groups()  # no cell runs on another's groups
            # The cell's objects go now, not whenever the collector runs: the process groups it
            # destroyed keep their threads and sockets while anything (a cycle of hooks) holds them.
            del parallel, pipe, encoder
            gc.collect()
        if dist.is_initialized():
            dist.barrier()  # every rank's part of the cell done before its record says so
        if not is_rank0():
            continue
        result_spec = dataclasses.replace(spec, dtype=result["dtype"])
        same_weights = _reference_of(result_spec, references, quantized=True) if spec.quantize is not None else None
        record = {**compare(result_spec, result, _reference_of(result_spec, references), same_weights),
                  **{k: result.get(k) for k in KEPT}, **evidence,
                  "pictures": len(result["videos"] or result["images"] or [])}
        record["latent_rel_diff"] = record.pop("latent")["max_rel_diff"]
        record.pop("image")
        record["wall_s"] = round(time.perf_counter() - began, 3)  # the cell's runs and its reference, on rank 0
        (out_dir / f"{name}.json").write_text(json.dumps(record, default=str))

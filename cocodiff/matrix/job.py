"""What each rank runs for the matrix: one model's cells of one world size, in a row.

Every cell is `verify`'s run (`run.jobs`): a fresh pipeline, `parallelize` with the cell's
config, the pipeline call, the undo. Rank 0 compares each with the one-process run of the same
request, computed once per request (the cells of a model share a few) and kept. Each finished
cell's record is written at once to its own file, so a cell that fails leaves the ones before it
read, and the runner starts the rest anew.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..config.parallel import ParallelConfig
from ..distributed.topology import bound_device
from ..engine.offload import place_text_encoders
from ..run.jobs import compare, generate_run
from ..run.load import load_spec_pipeline
from ..run.pipeline import is_rank0, run_pipeline
from ..run.spec import GenerateSpec

__all__ = ["matrix_job"]

KEPT = ("plan", "plan_description", "comm", "exchange", "cache", "wire", "v_major", "bytes_by_level", "shard_weights",
        "offload_text_encoders", "parallel_vae", "compile", "transformer_param_bytes", "steps")
"""What a cell's record keeps of the run's own (the rest is the comparison)."""


def _request(spec: GenerateSpec) -> tuple:
    """What the one-process reference depends on: the request, not how it is run."""
    source = spec.source.report() if spec.source is not None else None
    return (spec.model, spec.steps, spec.height, spec.width, spec.frames, spec.batch, spec.seed, spec.dtype,
            json.dumps(source, sort_keys=True))


def _reference(spec: GenerateSpec) -> dict[str, Any]:
    """The stock pipeline's run of the same request in this process alone."""
    alone = dataclasses.replace(spec, parallel=ParallelConfig())
    pipe, encoder = load_spec_pipeline(alone)
    place_text_encoders(pipe, encoder, bound_device(), offload=False, encodes=True)
    pipe.set_progress_bar_config(disable=True)
    return run_pipeline(alone, pipe, encoder, None)


def matrix_job(cells: list[tuple[str, GenerateSpec, int]], out_dir: Path) -> None:
    """Run `cells` ((name, spec, runs) of one model) in order; rank 0 writes `<name>.json` for each."""
    from diffusers import DiffusionPipeline

    # No progress bars in the ranks: the runner reports per launch. A class default, read by every
    # pipeline this rank builds that sets none of its own (diffusers' `progress_bar`).
    DiffusionPipeline._progress_bar_config = {"disable": True}
    references: dict[tuple, dict[str, Any]] = {}
    for name, spec, runs in cells:
        for _ in range(runs):  # the last run counts (an earlier one calibrates: magcache)
            result, parallel, _pipe, _encoder = generate_run(dataclasses.replace(spec))
            if parallel is not None:
                parallel.undo()
        if dist.is_initialized():
            dist.barrier()  # every rank's part of the cell done before its record says so
        if not is_rank0():
            continue
        key = _request(result_spec := dataclasses.replace(spec, dtype=result["dtype"]))
        if key not in references:
            references[key] = _reference(result_spec)
        record = {**compare(result_spec, result, references[key]), **{k: result.get(k) for k in KEPT}}
        for picture in ("latent", "image"):
            record.pop(picture)
        (out_dir / f"{name}.json").write_text(json.dumps(record, default=str))

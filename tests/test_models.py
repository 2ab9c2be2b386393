"""Sequence-parallel FLUX, SD3.5-style and Qwen-Image equal one process, on 2 and 4 gloo ranks.

The presets have 4, 6 and 5 heads and the cases use 15 image and 7 text tokens, so on 4 ranks
both the heads and the tokens split unevenly; SD3 runs classifier-free guidance (batch 2) and
Qwen-Image a text mask with holes.
"""

import pytest
import torch
from conftest import RANK_TIMEOUT_S
from model_cases import FAMILIES, run_case

from cocodiff import ParallelConfig
from cocodiff.launch import spawn

# fp32 throughout. Sharded matmuls and attention over keys in another order round differently
# from one process (~1e-7 relative per operation); 1e-4 of the output's magnitude leaves room
# for that to compound over the layers and steps, while a wrong token, head or position gives
# differences of order 1e-1.
RTOL_OF_SCALE = 1e-4


# (ranks, comm, ranks per node, V-First)
SETUPS = {
    "2ranks-flat": (2, "flat", None, True),
    "4ranks-flat": (4, "flat", None, True),
    "2x2-tapa": (4, "tapa", 2, True),
    "2ranks-flat-novfirst": (2, "flat", None, False),
    "4ranks-flat-novfirst": (4, "flat", None, False),
    "2x2-tapa-novfirst": (4, "tapa", 2, False),
}


def all_families(comm: str, ranks_per_node: int | None, v_first: bool):
    config = ParallelConfig(comm=comm, ranks_per_node=ranks_per_node, v_first=v_first)
    return {model: run_case(model, config) for model in FAMILIES}


@pytest.fixture(scope="module")
def references():
    return {model: run_case(model, None) for model in FAMILIES}


_runs: dict[str, list] = {}


def runs_for(setup: str) -> list:
    if setup not in _runs:
        nproc, comm, ranks_per_node, v_first = SETUPS[setup]
        _runs[setup] = spawn(all_families, nproc, comm, ranks_per_node, v_first, timeout_s=RANK_TIMEOUT_S)
    return _runs[setup]


@pytest.fixture(scope="module", params=[name for name in SETUPS if not name.endswith("novfirst")])
def parallel_runs(request):
    return runs_for(request.param)


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("output", ["forward", "latents", "image"])
def test_parallel_equals_one_process(parallel_runs, references, model, output):
    expected = references[model][output]
    for rank, run in enumerate(parallel_runs):  # every rank ends with the same, full output
        got = run[model][output]
        assert got.shape == expected.shape
        scale = expected.abs().max().item()
        diff = (got - expected).abs().max().item()
        assert diff <= RTOL_OF_SCALE * scale, f"rank {rank}: max abs diff {diff:.3e} at scale {scale:.3e}"


@pytest.mark.parametrize("model", FAMILIES)
def test_tapa_is_bitwise_flat(model):
    """TAPA only moves data differently: the whole run is bit-for-bit the flat one."""
    tapa, flat = runs_for("2x2-tapa")[0][model], runs_for("4ranks-flat")[0][model]
    for output in ("forward", "latents", "image"):
        assert torch.equal(tapa[output], flat[output]), output


@pytest.mark.parametrize("setup", ["2ranks-flat", "4ranks-flat", "2x2-tapa"])
@pytest.mark.parametrize("model", FAMILIES)
def test_v_first_is_bitwise_the_plain_order(model, setup):
    """V-First only reorders work: every output is bit-for-bit the run without it."""
    with_v_first, without = runs_for(setup)[0][model], runs_for(f"{setup}-novfirst")[0][model]
    for output in ("forward", "latents", "image"):
        assert torch.equal(with_v_first[output], without[output]), output

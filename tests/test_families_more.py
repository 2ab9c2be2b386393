"""LTX-Video, Z-Image and HunyuanVideo 1.5 sequence-parallel equal one process, on 2 gloo ranks
(4 and 8 with `-m slow`: 8 ranks are more than the presets' 6 heads, so the plan adds a ring).

Each runs its stock pipeline (2 steps, tiny sizes, a few frames) through the generic family layer:
tiny-ltx splits its text and the text's additive per-head mask (cross-attention with S_q != S_kv
goes through the exchange; CFG in a batch of 2, the negative prompt's text wholly masked);
tiny-zimage has no `_cp_plan` (its plan is data in engine/families/__init__.py; its refiners run whole);
tiny-hunyuanvideo15 has no `_cp_plan` and builds an S x S mask from the local length.
"""

import pytest
import torch
from conftest import RANK_TIMEOUT_S

from cocodiff import ParallelConfig
from cocodiff.run.launch import spawn

# fp32 throughout. Sharded matmuls and attention over keys in another order round differently
# from one process (~1e-7 relative per operation). On a ring, LTX's wholly masked negative text
# (a -10000 bias on every key, where fp32 keeps ~1e-3 of the scores) folds block by block and
# differs by up to ~7e-5 of the output's scale: 1e-4 leaves room for that, while a wrong token,
# head, mask or position gives differences of order 1e-1.
RTOL_OF_SCALE = 1e-4

CASES = {  # model -> pipeline arguments: a few tokens per rank even on 8 ranks
    "tiny-ltx": {"height": 32, "width": 64, "num_frames": 5},  # 2 latent frames x 2 x 4 = 16 tokens, 11 text
    "tiny-zimage": {"height": 32, "width": 48},  # 6 image tokens padded to 32, + 32 text
    "tiny-hunyuanvideo15": {"height": 32, "width": 48, "num_frames": 5},  # 12 tokens; 729 image + 2 x 11 text
}


def run_case(model: str, config: ParallelConfig | None) -> torch.Tensor:
    from cocodiff import parallelize
    from cocodiff.models.presets import load_pipeline

    pipe, _ = load_pipeline(model, seed=0)
    pipe.set_progress_bar_config(disable=True)
    if config is not None:
        parallelize(pipe, config)
    out = pipe("a small green star", num_inference_steps=2, output_type="np",
               generator=torch.Generator().manual_seed(0), **CASES[model])
    return torch.as_tensor(out.frames if hasattr(out, "frames") else out.images)


def all_cases(config: ParallelConfig) -> dict[str, torch.Tensor]:
    return {model: run_case(model, config) for model in CASES}


@pytest.fixture(scope="module")
def references() -> dict[str, torch.Tensor]:
    return {model: run_case(model, None) for model in CASES}


_runs: dict[int, list] = {}


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def parallel_runs(request) -> list[dict[str, torch.Tensor]]:
    nproc = request.param
    if nproc not in _runs:  # one launch per rank count runs every family
        _runs[nproc] = spawn(all_cases, nproc, ParallelConfig(), timeout_s=RANK_TIMEOUT_S * max(1, nproc // 4))
    return _runs[nproc]


@pytest.mark.parametrize("model", CASES)
def test_parallel_equals_one_process(parallel_runs, references, model):
    expected = references[model]
    for rank, run in enumerate(parallel_runs):  # every rank ends with the same, full output
        got = run[model]
        assert got.shape == expected.shape
        scale = expected.abs().max().item()
        diff = (got - expected).abs().max().item()
        assert diff <= RTOL_OF_SCALE * scale, f"rank {rank}: max abs diff {diff:.3e} at scale {scale:.3e}"


def test_a_pipeline_without_step_callbacks_times_every_step():
    """HunyuanVideo 1.5's pipeline takes no `callback_on_step_end`: the scheduler's step stands in."""
    from cocodiff.run.jobs import generate_job
    from cocodiff.run.spec import GenerateSpec

    result = generate_job(GenerateSpec(model="tiny-hunyuanvideo15", steps=2, height=32, width=48, frames=5))
    assert len(result["step_ms"]) == 2 and all(ms > 0 for ms in result["step_ms"])

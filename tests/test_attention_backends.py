"""`--attention-backend` (engine/attention/backends.py): the attention runs on the named backend of
diffusers' dispatcher, through the hand-written processors and the stock ones alike, exact against
one process on the same kernel, and what ran is recorded; what cannot run is one line before any
rank. The matrix's `attention native` and `attention math` columns run it on every preset."""

from __future__ import annotations

import json

import pytest
from test_cli import cocodiff, exit_status

from cocodiff.engine.attention.backends import set_backend
from cocodiff.models.presets import load_pipeline


def test_verify_runs_the_backend_on_every_rank_and_records_it(tmp_path):
    figures = tmp_path / "v.json"
    run = cocodiff("verify", "--model", "tiny-flux", "--attention-backend", "_native_math", "--nproc", "2",
                   "--steps", "2", "--height", "64", "--width", "64", "--json", str(figures))
    assert run.returncode == 0, run.stderr
    result = json.loads(figures.read_text())
    assert result["ok"] and result["max_rel_diff"] <= result["tolerance"]
    # FLUX.1's hand-written processor called the dispatcher's math kernel, not torch's SDPA.
    assert result["attention_backend"] == {"name": "_native_math", "kernels": ["_native_math_attention"]}


def test_a_pipeline_gets_its_backend_and_the_process_keeps_its_default():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    default = _AttentionBackendRegistry.get_active_backend()[0]
    pipe = load_pipeline("tiny-wan")[0]
    set_backend(pipe, "_native_math")
    backends = lambda: {m.processor._attention_backend for m in pipe.transformer.modules()  # noqa: E731
                        if hasattr(m, "processor") and hasattr(m.processor, "_attention_backend")}
    assert backends() == {AttentionBackendName("_native_math")}
    assert _AttentionBackendRegistry.get_active_backend()[0] == default  # the next pipeline asks for its own
    set_backend(pipe, None)  # back on the default (bench e2e: the next variant on the same pipeline)
    assert backends() == {None}


@pytest.mark.parametrize(("model", "backend", "message"), [
    ("tiny-flux", "bogus", "--attention-backend bogus: no such backend in diffusers' dispatcher"),
    ("tiny-flux", "sage_hub", "--attention-backend sage_hub downloads its kernel from the hub"),
    ("tiny-wan", "_native_math", "--attention-backend _native_math: tiny-wan: its stock attention processors split"),
])
def test_a_backend_that_cannot_run_is_one_line_before_any_rank(capsys, no_ranks, model, backend, message):
    assert exit_status(["verify", "--model", model, "--nproc", "2", "--attention-backend", backend]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_gpu_backend_on_the_cpu_is_one_line(capsys, no_ranks):
    import torch

    from cocodiff.engine.attention.backends import _installed

    if torch.cuda.is_available():
        pytest.skip("a GPU runs it")
    backend = "_native_cudnn"  # torch's own: installed wherever torch is
    assert _installed(backend) is None
    assert exit_status(["verify", "--model", "tiny-flux", "--nproc", "2", "--attention-backend", backend]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--attention-backend {backend} needs a GPU" in err, err

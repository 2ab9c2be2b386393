"""`cocodiff train-tiny --device/--batch`: the batch reaches the training and training.json, a run
repeats for a fixed seed, device and batch, and what cannot run (CUDA without CUDA, a batch below
1, a resume with another batch or device) is refused in one line before training starts.

Short runs (2 autoencoder and 2 denoiser steps) on the CPU; the CUDA run's test needs a GPU.
"""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cocodiff.cli import main

SHORT = ["--steps", "2", "--ae-steps", "2", "--threads", "1", "--no-samples"]
PARTS = ("vae", "transformer", "text_encoder")


@pytest.fixture
def in_process(monkeypatch):
    """`main` trains in this process (no child process with its own torch import)."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")


def exit_status(argv: list[str]) -> int:
    """What `cocodiff ARGV` exits with: `main`'s return value, or the code argparse exits with inside it."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


def one_line_error(capsys, argv: list[str]) -> str:
    """The single stderr line of a refused `cocodiff ARGV` (exit 2, no traceback)."""
    capsys.readouterr()  # not an earlier run's progress bars
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def train(out, *flags: str) -> dict:
    assert main(["train-tiny", "--out", str(out), *SHORT, *flags]) == 0
    return json.loads((out / "training.json").read_text())


def weights(out) -> dict[str, dict[str, torch.Tensor]]:
    return {part: load_file(out / part / "diffusion_pytorch_model.safetensors") for part in PARTS}


def test_batch_reaches_the_denoiser_and_is_recorded(tmp_path, monkeypatch, in_process):
    from cocodiff.models.shapes.data import ShapesDataset
    from cocodiff.models.shapes.train import AE_DATA_OFFSET

    sizes = []
    batch = ShapesDataset.batch

    def counted(self, start, size):
        if start < AE_DATA_OFFSET // 2:  # the denoiser's samples (the autoencoder's start past the offset)
            sizes.append(size)
        return batch(self, start, size)

    monkeypatch.setattr(ShapesDataset, "batch", counted)
    record = train(tmp_path, "--batch", "3")
    assert sizes == [3, 3]
    assert record["batch"] == record["config"]["batch"] == 3
    assert record["device"] == record["config"]["device"] == "cpu" and "gpu" not in record
    assert record["config"]["ae_batch"] == 32  # --batch is the denoiser's alone
    checkpoint = torch.load(tmp_path / "checkpoints" / "step-000002.pt", weights_only=False)
    assert checkpoint["config"]["batch"] == 3 and checkpoint["config"]["device"] == "cpu"


def test_same_seed_device_and_batch_repeat_the_weights(tmp_path, in_process):
    for run, batch in (("a", "3"), ("b", "3"), ("other", "2")):
        train(tmp_path / run, "--seed", "4", "--device", "cpu", "--batch", batch)
    first, again, other = weights(tmp_path / "a"), weights(tmp_path / "b"), weights(tmp_path / "other")
    for part in PARTS:
        assert first[part].keys() == again[part].keys()
        assert all(torch.equal(first[part][name], again[part][name]) for name in first[part]), part
    # the comparison can tell runs apart: another batch is another run (the autoencoder is the same)
    assert not all(torch.equal(first["transformer"][name], other["transformer"][name]) for name in first["transformer"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_refused_in_one_line_by_the_command(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "cocodiff", "train-tiny", "--out", str(out), "--device", "cuda", *SHORT],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("cocodiff: error: --device cuda: CUDA is not available")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.exists()  # refused before anything was written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_runs_repeat_and_record_the_gpu(tmp_path, in_process):
    for run in ("a", "b"):
        record = train(tmp_path / run, "--device", "cuda", "--batch", "3")
    assert record["device"] == record["config"]["device"] == "cuda" and record["batch"] == 3
    assert record["gpu"] == torch.cuda.get_device_name() and record["precision"].startswith("bf16 autocast")
    first, again = weights(tmp_path / "a"), weights(tmp_path / "b")
    for part in PARTS:
        assert all(torch.equal(first[part][name], again[part][name]) for name in first[part]), part
    assert not torch.are_deterministic_algorithms_enabled()  # the run's settings do not outlive it


@pytest.mark.parametrize("flags, start", [
    (["--device", "gpu"], "cocodiff: error: --device gpu: expected cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], "cocodiff: error: --device cuda:99: "),  # no CUDA here, or not 100 GPUs
    (["--batch", "0"], "cocodiff: error: --batch 0 must be at least 1"),
    (["--batch", "-2"], "cocodiff: error: --batch -2 must be at least 1"),
    (["--threads", "0"], "cocodiff: error: --threads 0 must be at least 1"),
    (["--ae-steps", "0"], "cocodiff: error: --ae-steps 0 must be at least 1"),
])
def test_a_device_or_batch_that_cannot_run_is_refused_in_one_line(capsys, tmp_path, flags, start):
    out = tmp_path / "run"
    assert one_line_error(capsys, ["train-tiny", "--out", str(out), *SHORT, *flags]).startswith(start)
    assert not out.exists()


def test_resume_refuses_another_batch_or_device(capsys, tmp_path, monkeypatch, in_process):
    from cocodiff.models.shapes import train as training

    runs = []
    train_tiny = training.train_tiny

    def counted(*args, **kwargs):
        runs.append(args)
        return train_tiny(*args, **kwargs)

    monkeypatch.setattr(training, "train_tiny", counted)
    train(tmp_path, "--batch", "3")
    resume = ["train-tiny", "--out", str(tmp_path), *SHORT, "--resume"]
    line = one_line_error(capsys, [*resume, "--batch", "4"])
    assert f"--resume: {tmp_path / 'checkpoints' / 'step-000002.pt'} was trained with --device cpu --batch 3, " \
           "not --device cpu --batch 4" in line
    assert "--batch 3, not --device cpu --batch 12" in one_line_error(capsys, resume)  # the default is not adopted
    assert len(runs) == 1  # neither refusal trained

    assert train(tmp_path, "--resume", "--batch", "3", "--steps", "3")["denoiser_steps"] == 3  # its batch: resumed
    latest = tmp_path / "checkpoints" / "step-000003.pt"
    state = torch.load(latest, weights_only=False)
    state["config"]["device"], state["gpu"] = "cuda", "NVIDIA H200"  # as a CUDA run records it
    torch.save(state, latest)
    line = one_line_error(capsys, [*resume, "--batch", "3", "--steps", "3"])
    assert "was trained with --device cuda (NVIDIA H200) --batch 3, not --device cpu --batch 3" in line
    assert len(runs) == 2


@pytest.mark.parametrize("lr", ["nan", "inf", "-1", "0"])
def test_a_learning_rate_out_of_range_is_refused_before_training(tmp_path, capsys, lr):
    from cocodiff.cli import main

    out = tmp_path / "run"
    assert main(["train-tiny", "--out", str(out), "--lr", lr]) == 2
    err = capsys.readouterr().err
    assert err == f"cocodiff: error: --lr {float(lr):g} must be a learning rate between 0 and 1\n", err
    assert not out.exists()  # before the autoencoder trains, nothing written

"""Output files: checked before any rank starts, written whole, and never silently lost."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import RANK_TIMEOUT_S

from cocodiff.cli import main
from cocodiff.errors import RunFailed
from cocodiff.output.files import batch_paths, save_images
from cocodiff.output.atomic import replacing
from cocodiff.output.tables import write_json


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting ranks fails the test: the checks must come first."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr("cocodiff.run.launch.run_ranks", refuse)


@pytest.fixture
def places(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "a-1.png").mkdir()  # where the second image of a batch of 2 would go
    (tmp_path / "file").write_text("")
    (tmp_path / "results").mkdir()
    return tmp_path


def _cases():
    return [
        (["generate", "--out", "{t}/x.foo"], "'.foo' names no image format"),
        (["generate", "--out", "{t}/noextension"], "no extension names its format"),
        (["generate", "--json", "/dev/full"], "/dev/full is a character device, not a regular file"),
        (["generate", "--json", "/proc/nope/x.json"], "cannot write in /proc"),
        (["generate", "--json", "{t}/file/x.json"], "{t}/file is a file, not a folder"),
        (["generate", "--batch", "2", "--out", "{t}/a.png"], "--out {t}/a-1.png is a folder"),
        (["verify", "--json", "{t}/folder"], "--json {t}/folder is a folder"),
        (["bench", "e2e", "--json", "{t}/folder"], "--json {t}/folder is a folder"),
        (["bench", "a2a", "--json", "/dev/full"], "character device"),
        (["bench", "quality", "--grid", "{t}/file/g.png"], "{t}/file is a file, not a folder"),
        (["simulate", "--paper", "--json", "{t}/folder"], "--json {t}/folder is a folder"),
        (["simulate", "--paper", "--plot", "{t}/p.xyz"], "'.xyz' names no plot format"),
        (["report", "--results", "{t}/results", "--readme", "{t}/folder"], "--readme {t}/folder is a folder"),
        (["train-tiny", "--out", "{t}/file"], "--out {t}/file is a file, not a folder"),
        (["generate", "--image", "{t}/folder"], "--image {t}/folder is a folder"),
    ]


@pytest.mark.parametrize("args, message", _cases(), ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_an_output_that_cannot_be_written_is_one_line_before_anything_runs(args, message, places, no_ranks, capsys):
    code = main([a.format(t=places) for a in args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("cocodiff: error: ") and err.count("\n") == 1, err
    assert message.format(t=places) in err
    assert not any(p.name.startswith(".cocodiff-check-") for p in places.rglob("*"))  # the probe leaves nothing


def test_the_checks_create_nothing(tmp_path, no_ranks, capsys):
    """A creatable folder passes the check without being created (the run then fails on --model)."""
    assert main(["generate", "--out", str(tmp_path / "new" / "x.png"), "--model", "no-such-preset"]) == 2
    assert "no-such-preset" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("command", [["generate"]])  # bench e2e and bench quality call the same resolve_model (models/source.py)
def test_an_uncached_hub_id_offline_is_one_line(tmp_path, command):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run([sys.executable, "-m", "cocodiff", *command, "--model", "some-org/some-model", "--nproc", "4"],
                         capture_output=True, text=True, env=env, timeout=RANK_TIMEOUT_S)
    assert run.returncode == 2, run.stderr
    assert run.stderr == ("cocodiff: error: --model some-org/some-model: not a preset, not a local folder, and not in "
                          f"the Hugging Face cache (HF_HUB_OFFLINE=1, cache {tmp_path / 'hf' / 'hub'})\n")


def test_a_hub_id_in_the_cache_resolves_offline(tmp_path):
    """A snapshot in the Hugging Face cache's layout (refs/main -> snapshots/<commit>) is found without the network."""
    repo = tmp_path / "hf" / "hub" / "models--some-org--cached"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    (snapshot / "scheduler").mkdir(parents=True)
    (snapshot / "model_index.json").write_text(json.dumps(
        {"_class_name": "FluxPipeline", "_diffusers_version": "0.42.1",
         "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}))
    (snapshot / "scheduler" / "scheduler_config.json").write_text('{"_class_name": "FlowMatchEulerDiscreteScheduler"}')
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = "from cocodiff.models.source import resolve_model; resolve_model('some-org/cached'); print('found')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=RANK_TIMEOUT_S)
    assert run.returncode == 0 and run.stdout == "found\n", run.stderr
    assert "Could not reach the Hub" not in run.stderr


def test_replacing_leaves_the_old_file_whole_when_the_write_fails(tmp_path):
    path = tmp_path / "figures.json"
    path.write_text("old")
    with pytest.raises(OSError), replacing(path) as tmp:
        tmp.write_text("half of the new")
        raise OSError(28, "No space left on device")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["figures.json"]
    with replacing(path) as tmp:
        tmp.write_text("new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["figures.json"]


def test_a_json_that_cannot_be_written_at_the_end_is_printed_and_one_line(tmp_path, capsys):
    (tmp_path / "gone").write_text("")  # the folder became a file during the run
    with pytest.raises(RunFailed, match=r"--json .*gone/x.json could not be written .*the JSON is on stdout"):
        write_json(tmp_path / "gone" / "x.json", {"ok": True})
    assert json.loads(capsys.readouterr().out) == {"ok": True}


def test_an_image_that_cannot_be_written_at_the_end_is_kept_elsewhere(tmp_path):
    (tmp_path / "gone").write_text("")
    images = [np.full((8, 8, 3), 0.5, dtype=np.float32)] * 2
    paths = [tmp_path / "ok.png", tmp_path / "gone" / "x.png"]
    written, problem = save_images("--out", paths, images)
    try:
        assert written[0] == paths[0] and paths[0].stat().st_size > 0
        assert written[1] != paths[1] and written[1].stat().st_size > 0
        assert problem.startswith(f"--out {paths[1]} could not be written (")
        assert problem.endswith(f"; kept at {written[1]})") and "\n" not in problem
    finally:
        written[1].unlink(missing_ok=True)


def test_batch_paths():
    assert batch_paths(Path("d/x.png"), 1) == [Path("d/x.png")]
    assert batch_paths(Path("d/x.png"), 3) == [Path("d/x-0.png"), Path("d/x-1.png"), Path("d/x-2.png")]


def test_a_batch_writes_every_image(tmp_path):
    out, figures = tmp_path / "img.png", tmp_path / "g.json"
    run = subprocess.run(
        [sys.executable, "-m", "cocodiff", "generate", "--batch", "2", "--steps", "1", "--height", "64", "--width", "64",
         "--nproc", "1", "--out", str(out), "--json", str(figures)],
        capture_output=True, text=True, timeout=RANK_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr
    paths = [tmp_path / "img-0.png", tmp_path / "img-1.png"]
    assert all(p.stat().st_size > 0 for p in paths) and not out.exists()
    result = json.loads(figures.read_text())
    assert result["out"] == str(paths[0]) and result["outs"] == [str(p) for p in paths]
    assert "img-1.png" in run.stdout


def test_a_checkpoint_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """torch.save interrupted half-way (a full disk, a kill) leaves no checkpoint for --resume to trip on."""
    from cocodiff.models.shapes import train

    real_save = torch.save

    def interrupted(obj, path):
        real_save(obj, path)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", interrupted)
    config = train.TrainConfig(seed=5, threads=1, ae_steps=1, ae_batch=2, sample_grid=False)
    with pytest.raises(OSError):
        train.train_autoencoder(config, tmp_path, {"autoencoder": [], "denoiser": []}, {})
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_truncated_checkpoint_is_named_on_resume(tmp_path, monkeypatch, capsys):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    torch.save({"step": 2}, checkpoints / "step-000002.pt")
    whole = (checkpoints / "step-000002.pt").read_bytes()
    (checkpoints / "step-000004.pt").write_bytes(whole[: len(whole) // 2])
    assert zipfile.is_zipfile(checkpoints / "step-000002.pt")

    def refuse(*_args, **_kwargs):
        raise AssertionError("training started")

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # train in this process (refused), not in a child
    monkeypatch.setattr("cocodiff.models.shapes.train.train_tiny", refuse)
    assert main(["train-tiny", "--out", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err == (f"cocodiff: error: --resume: checkpoint {checkpoints / 'step-000004.pt'} is truncated or corrupt "
                   "(File is not a zip file); remove it to resume from the one before\n")

"""The `cocodiff train-tiny` subcommand: its arguments and its run (kept here, out of cocodiff/cli.py).

    cocodiff train-tiny --out DIR [--seed 0] [--threads 2] [--device cpu|cuda|cuda:N] [--batch B] [--steps N]
                        [--init DIR] [--lr LR] [--decay-share S] [--resume]

With the defaults it reproduces the shipped `tiny-shapes` weights (cocodiff/models/shapes/weights/, whose
training.json records the run). Importing this module is cheap: torch and diffusers load only
when training starts. Every refusal (a flag, an unavailable device, a checkpoint that is not this
run's) is one line, exit 2, before training starts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

__all__ = ["add_train_arguments", "check_checkpoints", "check_device", "check_same_run", "resumable", "train_from_args"]

_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


def _train(out: Path, config: Any, command: str | None, prologue: Callable[[], None] | None = None) -> None:
    if prologue is not None:
        prologue()  # e.g. die with the command (`train_from_args`)
    from .train import train_tiny

    train_tiny(out, config, command=command)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    from cocodiff.config.flags import ascii_int

    parser.add_argument("--out", type=Path, required=True, help="output folder: pipeline parts, checkpoints, loss.png, samples.png")
    parser.add_argument("--seed", type=ascii_int, default=0, help="seed of the data, the initial weights and the noise")
    parser.add_argument("--threads", type=ascii_int, default=2, help="torch CPU threads (results are repeatable for a fixed count)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu, the shipped run's recipe, fp32). On CUDA the "
                        "forward passes run under bf16 autocast (weights and optimizer fp32), TF32 off, deterministic kernels: "
                        "a run repeats for a fixed seed, batch and GPU model; the data and noise are the CPU run's")
    parser.add_argument("--batch", type=ascii_int, default=None, help="images per denoiser step (default: the shipped run's). The "
                        "autoencoder keeps its own batch (32 crops); the learning rate does not follow the batch (scale --lr "
                        "yourself); a different batch is a different data order")
    parser.add_argument("--steps", type=ascii_int, default=None, help="denoiser steps (default: those of the shipped run)")
    parser.add_argument("--ae-steps", type=ascii_int, default=None, help="autoencoder steps (default: those of the shipped run)")
    parser.add_argument("--init", type=Path, default=None, help="train further from a train-tiny output folder (e.g. cocodiff/models/shapes/weights): keeps its autoencoder, starts from its transformer and text encoder")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate of the denoiser (default: the shipped run's)")
    parser.add_argument("--decay-share", type=float, default=None, help="decay the learning rate over this last share of the steps (default 1.0)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out, with the "
                        "--device (cpu, or a GPU of the same model) and --batch its checkpoints record; others are refused")
    parser.add_argument("--no-samples", action="store_true", help="skip the sample grid at the end")


def resumable(out: Path) -> bool:
    """Whether `out` holds a checkpoint `--resume` continues from: the autoencoder's or a step's."""
    folder = out / "checkpoints"
    return (folder / "vae.pt").is_file() or any(folder.glob("step-*.pt"))


def check_checkpoints(out: Path) -> None:
    """The checkpoints `--resume` would load (the autoencoder's and the latest step's) are whole:
    a zip archive (torch.save's format) whose every member's CRC matches. One line otherwise."""
    import zipfile

    from cocodiff.errors import UsageError

    steps = sorted((out / "checkpoints").glob("step-*.pt"))
    for path in [p for p in (out / "checkpoints" / "vae.pt", *steps[-1:]) if p.exists()]:
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
            problem = f"its part {bad} does not match its checksum" if bad else None
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            problem = f"{error}"
        if problem:
            raise UsageError(f"--resume: checkpoint {path} is truncated or corrupt ({problem}); remove it to resume "
                             f"from the one before")


def check_device(device: str) -> None:
    """`--device` names a device this machine has: `cpu`, or `cuda` / `cuda:N` with CUDA available. One line otherwise."""
    import torch

    from cocodiff.errors import UsageError

    if not _DEVICE.fullmatch(device):
        raise UsageError(f"--device {device}: expected cpu, cuda or cuda:N")
    if device == "cpu":
        return
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise UsageError(f"--device {device}: CUDA is not available ({why}, torch {torch.__version__}); use --device cpu")
    count, index = torch.cuda.device_count(), torch.device(device).index
    if index is not None and index >= count:
        raise UsageError(f"--device {device}: this machine has {count} CUDA device{'s' if count > 1 else ''} "
                         f"(cuda:0 to cuda:{count - 1})")


def check_same_run(out: Path, device: str, batch: int) -> None:
    """`--resume` continues the run its checkpoints hold, so it refuses, in one line, a device or a
    batch other than theirs: the latest step's checkpoint records both (the autoencoder's, the
    device). Devices match when both are the CPU, or CUDA GPUs of the same model (its index does
    not change the numbers). Checkpoints from before `--device` were trained on the CPU."""
    import torch

    from cocodiff.errors import UsageError

    from .train import gpu_name

    steps = sorted((out / "checkpoints").glob("step-*.pt"))
    path = steps[-1] if steps else out / "checkpoints" / "vae.pt"
    if not path.exists():
        return
    state = torch.load(path, map_location="cpu", weights_only=False)
    recorded = state["config"] if steps else state
    was_device, was_gpu = recorded.get("device", "cpu"), state.get("gpu")
    was_batch = recorded["batch"] if steps else batch  # the autoencoder's checkpoint is before any denoiser batch
    same_device = torch.device(was_device).type == torch.device(device).type and was_gpu == gpu_name(device)
    if not same_device or was_batch != batch:
        def named(dev: str, gpu: str | None) -> str:
            return f"--device {dev}" + (f" ({gpu})" if gpu else "")

        raise UsageError(f"--resume: {path} was trained with {named(was_device, was_gpu)} --batch {was_batch}, not "
                         f"{named(device, gpu_name(device))} --batch {batch}; resume with its device and batch, or "
                         f"start a new --out")


def train_from_args(args: argparse.Namespace, child_prologue: Callable[[], None] | None = None) -> int:
    """`train-tiny`: its flags checked, then the run, in a child process of its own unless the
    OpenMP policy is set already; `child_prologue` is the child's first call (the command line
    has it die with the command, so that no training outlives it)."""
    from cocodiff.errors import UsageError
    from cocodiff.output.files import check_folder
    from .train import TrainConfig, train_tiny

    check_device(args.device)
    if args.batch is not None and args.batch < 1:
        raise UsageError(f"--batch {args.batch} must be at least 1")
    check_folder("--out", args.out)
    if args.out.exists() and any(args.out.iterdir()) and not args.resume:
        raise UsageError(f"--out {args.out} is not empty; pass --resume to continue a run there")
    if args.resume:
        if not resumable(args.out):  # a mistyped --out would otherwise start a 45-minute run from scratch
            raise UsageError(f"--resume: --out {args.out} has no checkpoint to resume from (no "
                             f"checkpoints/vae.pt or checkpoints/step-*.pt); leave out --resume to start from scratch")
        check_checkpoints(args.out)
    config = TrainConfig(seed=args.seed, threads=args.threads, device=args.device, sample_grid=not args.no_samples)
    if args.batch is not None:
        config.batch = args.batch
    if args.resume:
        check_same_run(args.out, config.device, config.batch)
    if args.steps is not None:
        config.steps = args.steps
    if args.ae_steps is not None:
        config.ae_steps = args.ae_steps
    if args.init is not None:
        missing = [part for part in ("vae", "transformer", "text_encoder") if not (args.init / part).is_dir()]
        if missing:
            raise UsageError(f"--init {args.init} has no {', '.join(missing)}: not a train-tiny output folder")
        config.init = str(args.init)
    if args.lr is not None:
        if not 0 < args.lr < 1:  # also NaN and infinity: refused before the autoencoder trains, not after
            raise UsageError(f"--lr {args.lr:g} must be a learning rate between 0 and 1")
        config.lr = args.lr
    if args.decay_share is not None:
        if not 0.0 < args.decay_share <= 1.0:
            raise UsageError(f"--decay-share {args.decay_share} is outside (0, 1]")
        config.decay_share = args.decay_share
    for flag, value in (("--steps", config.steps), ("--ae-steps", config.ae_steps), ("--threads", config.threads)):
        if value < 1:
            raise UsageError(f"{flag} {value} must be at least 1")
    command = "cocodiff " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["train-tiny"] else None
    if "OMP_WAIT_POLICY" in os.environ:
        record = train_tiny(args.out, config, command=command)
    else:
        # OpenMP threads that spin at barriers stall whenever another process shares the cores
        # (measured here: 10x slower steps with 2 threads); passive waiting does not. The policy
        # is read when torch loads, so the run goes to a fresh process that has it.
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        child = multiprocessing.get_context("spawn").Process(target=_train, args=(args.out, config, command, child_prologue))
        child.start()
        try:
            child.join()
        finally:  # stopped by a signal: the training goes with the command
            if child.is_alive():
                child.kill()
                child.join()
        if child.exitcode != 0:
            return 1
        record = json.loads((args.out / "training.json").read_text())
    print(json.dumps({k: record[k] for k in ("seed", "device", "batch", "denoiser_steps", "wall_s", "final_loss")}, indent=2))
    print(f"pipeline parts, loss.png and samples.png in {args.out}")
    return 0

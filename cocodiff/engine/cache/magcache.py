"""MagCache's magnitude-ratio curve: measured once per model by a calibration run, stored as JSON,
read by every later run of that model.

The ratio of step s is the mean over the image tokens of `|r_s| / |r_{s-1}|`, r the residual the
cached blocks add (per-token L2 norms): how fast the residual's magnitude changes. On a skipped
run MagCache multiplies the ratios of the steps since the last computed one and accumulates the
error `|1 - product|`; below the threshold the last residual is reused.

Where: `$COCODIFF_CACHE_DIR` (default `$XDG_CACHE_HOME/cocodiff`, else `~/.cache/cocodiff`), under
`magcache/<class>-<fingerprint>.json`; the fingerprint hashes the transformer's class, config (less
diffusers' `_` notes) and a sum of each weight, so another checkpoint of the same architecture calibrates anew. A `--cache
magcache` run that finds no curve (on some rank) is the calibration run: it skips nothing and
measures the curve. The ratios are summed over every rank, so every rank holds the same curve; one
rank stores it (`StepCache.finish`, after the run, outside the transformer's forward and every
collective), and a filesystem error there is a warning: it changes nothing in the run, and a later
run that finds no curve calibrates again.

A run with another number of steps than the calibration's reads the curve through the timestep:
each calibrated ratio is a rate of change per unit of timestep (`log(ratio) / (t_prev - t)`),
interpolated at the step's midpoint and raised to the step's length. With the calibrated
timesteps it gives the calibrated ratios back.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cocodiff.config.env import CACHE_DIR_ENV

from ..families import class_name

__all__ = ["CACHE_DIR_ENV", "MagCurve", "agreed_curve", "cache_dir", "curve_path", "load_curve", "store_curve"]



def cache_dir() -> Path:
    """Where the engine keeps what it calibrates (`$COCODIFF_CACHE_DIR`, else the user's cache folder)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cocodiff"


def curve_path(transformer: torch.nn.Module) -> Path:
    """This transformer's curve file: its class and a fingerprint of its config and weights."""
    digest = hashlib.sha256(class_name(transformer).encode())
    config = {k: v for k, v in dict(getattr(transformer, "config", None) or {}).items()
              if not k.startswith("_")}  # diffusers' own notes (`_use_default_values`: a set's order, per process)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        sums = [torch.sum(p.detach(), dtype=torch.float64) for p in transformer.parameters()]
    digest.update(repr([round(float(s), 6) for s in sums]).encode())  # rounded: the same on any device
    return cache_dir() / "magcache" / f"{class_name(transformer)}-{digest.hexdigest()[:16]}.json"


@dataclass(frozen=True, slots=True)
class MagCurve:
    """The calibrated ratios, one per step of the calibration run (step 0's is 1: nothing before it)."""

    timesteps: tuple[float, ...]
    ratios: tuple[float, ...]

    @property
    def steps(self) -> int:
        return len(self.ratios)

    def checksum(self) -> float:
        """One number the ranks compare (summed over them) to see that they read the same curve."""
        return float(sum(self.ratios) + 1e-3 * sum(self.timesteps))

    def ratio(self, previous: float, timestep: float) -> float:
        """The ratio of a step from `previous` to `timestep` (the calibrated one when they match)."""
        pairs = [(a, b, r) for a, b, r in zip(self.timesteps, self.timesteps[1:], self.ratios[1:]) if a != b and r > 0]
        for a, b, r in pairs:
            if math.isclose(a, previous, abs_tol=1e-6) and math.isclose(b, timestep, abs_tol=1e-6):
                return r
        if not pairs or previous == timestep:
            return 1.0
        order = sorted(pairs, key=lambda p: (p[0] + p[1]) / 2)
        middles = [(a + b) / 2 for a, b, _ in order]
        rates = [math.log(r) / (a - b) for a, b, r in order]
        rate = float(np.interp((previous + timestep) / 2, middles, rates))
        return math.exp(rate * (previous - timestep))


def load_curve(path: Path) -> MagCurve | None:
    """The curve stored at `path`; None when there is none (or it cannot be read: calibrate again)."""
    try:
        data = json.loads(path.read_text())
        curve = MagCurve(tuple(float(t) for t in data["timesteps"]), tuple(float(r) for r in data["ratios"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return curve if curve.steps >= 2 and len(curve.timesteps) == curve.steps else None


def agreed_curve(path: Path, agree: Callable[[torch.Tensor], list[float]], device: torch.device) -> MagCurve | None:
    """The curve stored at `path` when every rank read the same one, else None (every rank
    together: `agree` sums over them). Where some ranks found none and others one, every rank
    reads again after the agreement: one rank stores a calibrated curve (`StepCache.finish`), and
    the others may have looked before it had; once they all agreed, it has (it stores before it
    reaches this agreement)."""
    for _ in range(2):
        curve = load_curve(path)
        mine = [1.0, 0.0, curve.checksum()] if curve is not None else [1.0, 1.0, 0.0]
        ranks, missing, checksum = agree(torch.tensor(mine, dtype=torch.float64, device=device))
        if not 0 < missing < ranks:  # the same on every rank: agreed
            break
    same = curve is not None and missing == 0 and math.isclose(checksum, ranks * curve.checksum(), rel_tol=1e-9)
    return curve if same else None


def store_curve(path: Path, curve: MagCurve) -> None:
    """Write `curve` to `path` whole: into a temporary file beside it, then renamed over it (a
    reader never sees half a file). The temporary name is random, not only the pid, which repeats
    across the hosts of a shared filesystem: two writers of the same curve each rename a whole file
    of their own. Raises the filesystem's OSError (the temporary file removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"steps": curve.steps, "timesteps": list(curve.timesteps), "ratios": list(curve.ratios)},
                      indent=1)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask's permissions, as any file
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise

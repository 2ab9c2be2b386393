"""`cocodiff train-tiny`: train `tiny-shapes` from scratch on 2 CPU cores (or a GPU), deterministically.

Two stages, both on procedural data (data.py), so nothing is downloaded:

1. The autoencoder (VAE factor 2) learns to reconstruct random 32x32 crops of the images (it is
   fully convolutional, so crops cost a quarter of whole images and teach the same thing), as a
   plain autoencoder on the posterior mean (the pipeline only decodes, and the denoiser trains
   on the mean) with a small L2 penalty keeping latents in range. Then its latents' mean and
   standard deviation become the config's `shift_factor` / `scaling_factor`, as for the VAEs of
   FLUX and SD3.
2. The FLUX transformer and the text encoder learn jointly by rectified flow (flow matching), as
   FLUX and SD3 are trained: x_t = (1 - t) x_0 + t noise with t logit-normal, and the transformer
   predicts the velocity noise - x_0, which is what `FlowMatchEulerDiscreteScheduler` integrates.
   One caption in ten is replaced by the empty prompt, so the pipeline can apply classifier-free
   guidance. The shipped weights are an exponential moving average of the trained ones.

Determinism: batch `k` holds dataset samples k*B .. k*B+B-1, and the noise, timesteps and caption
drops of step `k` come from a generator seeded with (seed, k); with the same seed, thread count
and machine the run is bit-for-bit repeatable, and resuming from a checkpoint continues the same run.

Devices (`TrainConfig.device`): on the CPU everything is fp32. On CUDA the training forward passes
run under bf16 autocast (weights, gradients and the optimizer stay fp32; the frozen autoencoder's
encoding of the targets and its latent statistics stay fp32), TF32 is off, and kernels are the
deterministic ones, so the same seed, batch and GPU repeat a run. The initial weights and every
random draw (crops, caption drops, timesteps, noise) come from the same CPU generators on either
device and are copied over: a CUDA run sees exactly the CPU run's data and noise; only its
arithmetic differs.

Output folder (every file written whole or not at all, `output.atomic.replacing`): the pipeline parts (vae/, transformer/, text_encoder/, scheduler/, loadable with
`from_pretrained`), checkpoints/, losses.json, loss.png, samples.png and training.json (command,
seed, device, batch, GPU name on CUDA, steps, wall and CPU time, final loss).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, FluxTransformer2DModel
from tqdm.auto import tqdm

from cocodiff.output.files import save_figure
from cocodiff.output.atomic import replacing, replacing_folder, write_bytes
from .data import SIZE, ShapesDataset
from .model import (
    PARTS,
    TEXT_TOKENS,
    image_ids,
    new_scheduler,
    new_text_encoder,
    new_transformer,
    new_vae,
    pack,
)
from .text import ShapesTextEncoder

__all__ = ["TrainConfig", "gpu_name", "train_tiny"]

AE_DATA_OFFSET = 10**9
"""The autoencoder's samples start here, so the two stages see different images."""


@dataclass
class TrainConfig:
    seed: int = 0
    threads: int = 2
    device: str = "cpu"
    """`cpu`, `cuda` or `cuda:N`: where both stages train (see the module docstring for CUDA's recipe)."""
    ae_steps: int = 1200
    ae_batch: int = 32
    """Crops per autoencoder step; `batch` does not change it."""
    ae_crop: int = 32
    ae_lr: float = 4e-3
    steps: int = 4500
    batch: int = 12
    """Images per denoiser step: step `k` trains on samples k*batch .. k*batch+batch-1. `lr` does
    not follow it."""
    lr: float = 1e-3
    warmup: int = 200
    final_lr_share: float = 0.1
    decay_share: float = 1.0
    """The learning rate holds its peak after warm-up, then decays (cosine) over this last share of
    the steps; 1.0 decays from the end of warm-up. Below 1.0, runs of different lengths share every
    step before their decay (a longer run is a shorter one's prefix up to there)."""
    ema_decay: float = 0.998
    caption_dropout: float = 0.1
    init: str | None = None
    """A `train-tiny` output folder to start from: its autoencoder is kept (stage 1 is skipped) and
    its transformer and text encoder are the starting weights of stage 2 (both the trained and the
    EMA copies), so a finished run can be trained further with a new schedule."""
    checkpoint_every: int = 500
    sample_grid: bool = True


def _images(batch: np.ndarray) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float in [-1, 1]."""
    return torch.from_numpy(batch).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def _step_generator(seed: int, stage: int, step: int) -> torch.Generator:
    """The CPU generator of one step's random draws, on every device (the draws are copied over)."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, stage, step]).generate_state(1)[0]))


def gpu_name(device: str) -> str | None:
    """The GPU's model name for a CUDA device (`torch.cuda.get_device_name`), None for the CPU."""
    return torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else None


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast for the training forward passes on CUDA; nothing on the CPU, which stays fp32."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def _repeatable_arithmetic(device: torch.device) -> Iterator[None]:
    """On CUDA, for the run's length: deterministic kernels (cuBLAS needs its fixed workspace for
    that, set before its first call; flash attention's backward then sums in a fixed order) and
    TF32 off, so what autocast leaves in fp32 is computed in fp32. The CPU's settings are left alone."""
    if device.type != "cuda":
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark = saved[2]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[3], saved[4]


def _lr_factor(config: TrainConfig, step: int) -> float:
    """Linear warm-up, the peak, then cosine decay over the last `decay_share` of the steps to `final_lr_share` of the peak."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    decay_start = max(config.warmup, config.steps - round(config.decay_share * config.steps))
    if step < decay_start:
        return 1.0
    progress = (step - decay_start) / max(config.steps - decay_start, 1)
    return config.final_lr_share + (1 - config.final_lr_share) * 0.5 * (1 + math.cos(math.pi * progress))


def train_autoencoder(config: TrainConfig, out: Path, losses: dict[str, list[float]], times: dict[str, float]) -> Any:
    """Stage 1: the VAE, then its latent statistics into its config. Returns the trained VAE.

    `times` receives the stage's wall and process CPU seconds (`autoencoder_s`, `autoencoder_cpu_s`),
    also when the stage is loaded from its checkpoint.
    """
    checkpoint = out / "checkpoints" / "vae.pt"
    device = torch.device(config.device)
    torch.manual_seed(config.seed)
    vae = new_vae().to(device)  # initialized on the CPU, as on every device
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        vae.load_state_dict(state["vae"])
        vae.register_to_config(**state["factors"])
        losses["autoencoder"] = state["losses"]
        times.update(state.get("times", {}))
        return vae.eval().requires_grad_(False)
    started, cpu_started = time.perf_counter(), time.process_time()
    data = ShapesDataset(config.seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=config.ae_lr, weight_decay=0.0)
    vae.train()
    bar = tqdm(range(config.ae_steps), desc="autoencoder", unit="step", dynamic_ncols=True)
    for step in bar:
        g = _step_generator(config.seed, 1, step)
        images = _images(data.batch(AE_DATA_OFFSET + step * config.ae_batch, config.ae_batch)[0])
        top, left = torch.randint(0, SIZE - config.ae_crop + 1, (2,), generator=g).tolist()
        x = images[:, :, top : top + config.ae_crop, left : left + config.ae_crop].to(device)
        with _autocast(device):
            z = vae.encode(x).latent_dist.mode()
            recon = vae.decode(z).sample
        z, recon = z.float(), recon.float()  # the loss in fp32 (a no-op on the CPU)
        loss = (recon - x).abs().mean() + F.mse_loss(recon, x) + 1e-4 * z.pow(2).mean()
        for group in optimizer.param_groups:
            group["lr"] = config.ae_lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / config.ae_steps))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        losses["autoencoder"].append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.4f}")
    vae.eval().requires_grad_(False)
    with torch.no_grad():  # latent statistics over 256 unseen images
        z = torch.cat([vae.encode(_images(data.batch(AE_DATA_OFFSET // 2 + i * 32, 32)[0]).to(device)).latent_dist.mode() for i in range(8)])
    factors = {"shift_factor": z.mean().item(), "scaling_factor": 1.0 / z.std().item()}
    vae.register_to_config(**factors)
    times.update(autoencoder_s=time.perf_counter() - started, autoencoder_cpu_s=time.process_time() - cpu_started)
    with replacing(checkpoint) as tmp:  # whole or absent: --resume never meets half a checkpoint
        torch.save({"vae": vae.state_dict(), "factors": factors, "losses": losses["autoencoder"], "times": times,
                    "device": config.device, "gpu": gpu_name(config.device)}, tmp)
    return vae


def _latest_checkpoint(out: Path) -> Path | None:
    found = sorted((out / "checkpoints").glob("step-*.pt"))
    return found[-1] if found else None


def train_denoiser(
    config: TrainConfig, out: Path, vae: Any, losses: dict[str, list[float]], times: dict[str, float],
) -> tuple[Any, Any]:
    """Stage 2: transformer and text encoder by flow matching. Returns their EMA copies.

    `times` receives the stage's wall and process CPU seconds (`denoiser_s`, `denoiser_cpu_s`),
    summed over the runs that a resumed training is made of.
    """
    device = torch.device(config.device)
    torch.manual_seed(config.seed + 1)
    transformer, encoder = new_transformer(), new_text_encoder()
    if config.init is not None:
        transformer.load_state_dict(FluxTransformer2DModel.from_pretrained(Path(config.init) / "transformer", low_cpu_mem_usage=False).state_dict())
        encoder.load_state_dict(ShapesTextEncoder.from_pretrained(Path(config.init) / "text_encoder", low_cpu_mem_usage=False).state_dict())
    transformer, encoder = transformer.to(device), encoder.to(device)  # initialized on the CPU, as on every device
    ema_transformer, ema_encoder = copy.deepcopy(transformer), copy.deepcopy(encoder)
    params = [*transformer.parameters(), *encoder.parameters()]
    ema_params = [*ema_transformer.parameters(), *ema_encoder.parameters()]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.01, betas=(0.9, 0.99))
    start = 0
    latest = _latest_checkpoint(out)
    if latest is not None:
        state = torch.load(latest, map_location=device, weights_only=False)
        for module, key in ((transformer, "transformer"), (encoder, "encoder"), (ema_transformer, "ema_transformer"), (ema_encoder, "ema_encoder")):
            module.load_state_dict(state[key])
        optimizer.load_state_dict(state["optimizer"])
        start, losses["denoiser"] = state["step"], state["losses"]
        times.update(state.get("times", {}))
    spent, cpu_spent = times.get("denoiser_s", 0.0), times.get("denoiser_cpu_s", 0.0)
    started, cpu_started = time.perf_counter(), time.process_time()
    data = ShapesDataset(config.seed)
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    latent_size = SIZE // 2
    img_ids, txt_ids = image_ids(latent_size, latent_size).to(device), torch.zeros(TEXT_TOKENS, 3, device=device)
    transformer.train()
    encoder.train()
    bar = tqdm(range(start, config.steps), desc="denoiser", unit="step", initial=start, total=config.steps, dynamic_ncols=True)
    for step in bar:
        g = _step_generator(config.seed, 2, step)
        images, captions = data.batch(step * config.batch, config.batch)
        with torch.no_grad():  # the targets: in fp32 on every device
            x0 = pack((vae.encode(_images(images).to(device)).latent_dist.mode() - shift) * scale)  # (B, 256, 16)
        drop = (torch.rand(config.batch, generator=g) < config.caption_dropout).tolist()
        ids = encoder.tokenize(["" if d else c for c, d in zip(captions, drop)]).to(device)
        t = torch.sigmoid(torch.randn(config.batch, generator=g)).to(device)
        noise = torch.randn(x0.shape, generator=g).to(device)
        xt = (1 - t)[:, None, None] * x0 + t[:, None, None] * noise
        with _autocast(device):
            embeds, pooled = encoder.encode(ids)
            prediction = transformer(
                hidden_states=xt, timestep=t, pooled_projections=pooled, encoder_hidden_states=embeds,
                txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
            )[0]
        loss = F.mse_loss(prediction.float(), noise - x0)  # the loss in fp32 (.float() is a no-op on the CPU)
        for group in optimizer.param_groups:
            group["lr"] = config.lr * _lr_factor(config, step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        with torch.no_grad():  # EMA, with a short effective horizon at the start
            decay = min(config.ema_decay, (1 + step) / (10 + step))
            torch._foreach_lerp_(ema_params, params, 1 - decay)
        losses["denoiser"].append(loss.item())
        bar.set_postfix(loss=f"{np.mean(losses['denoiser'][-50:]):.4f}", lr=f"{group['lr']:.1e}")
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
            times.update(denoiser_s=spent + time.perf_counter() - started, denoiser_cpu_s=cpu_spent + time.process_time() - cpu_started)
            with replacing(out / "checkpoints" / f"step-{step + 1:06d}.pt") as tmp:
                torch.save({
                    "step": step + 1, "transformer": transformer.state_dict(), "encoder": encoder.state_dict(),
                    "ema_transformer": ema_transformer.state_dict(), "ema_encoder": ema_encoder.state_dict(),
                    "optimizer": optimizer.state_dict(), "losses": losses["denoiser"], "config": asdict(config),
                    "times": {k: v for k, v in times.items() if k.startswith("denoiser")},
                    "gpu": gpu_name(config.device),
                }, tmp)
    return ema_transformer.eval(), ema_encoder.eval()


def plot_losses(losses: dict[str, list[float]], path: Path) -> None:
    """Both stages' losses per step (and a 50-step moving average) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (name, values) in zip(axes, losses.items()):
        steps = np.arange(1, len(values) + 1)
        ax.plot(steps, values, lw=0.6, alpha=0.4, label="per step")
        if len(values) >= 50:
            ax.plot(steps[49:], np.convolve(values, np.ones(50) / 50, mode="valid"), lw=1.5, label="50-step mean")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(f"{name} loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)


def train_tiny(out: Path, config: TrainConfig | None = None, command: str | None = None) -> dict[str, Any]:
    """Train all parts into `out` (resuming from its checkpoints if any); returns training.json's content."""
    from .evaluate import sample_grid

    config = config or TrainConfig()
    out = Path(out)
    device = torch.device(config.device)
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(config.threads)
    losses: dict[str, list[float]] = {"autoencoder": [], "denoiser": []}
    times: dict[str, float] = {}
    with _repeatable_arithmetic(device):
        if config.init is None:
            vae = train_autoencoder(config, out, losses, times)
        else:
            vae = AutoencoderKL.from_pretrained(Path(config.init) / "vae", low_cpu_mem_usage=False).eval().requires_grad_(False).to(device)
        transformer, encoder = train_denoiser(config, out, vae, losses, times)
    vae, transformer, encoder = vae.to("cpu"), transformer.to("cpu"), encoder.to("cpu")  # no-ops on the CPU
    for name, part in (("vae", vae), ("transformer", transformer), ("text_encoder", encoder), ("scheduler", new_scheduler())):
        with replacing_folder(out / name) as tmp:
            part.save_pretrained(tmp)
    write_bytes(out / "losses.json", (json.dumps(losses) + "\n").encode())
    plot_losses(losses, out / "loss.png")
    record = {
        "command": command or "cocodiff train-tiny --out " + str(out),
        "seed": config.seed,
        "device": config.device,
        **({"gpu": gpu_name(config.device)} if device.type == "cuda" else {}),
        "batch": config.batch,
        "precision": "bf16 autocast; fp32 weights, gradients and optimizer; TF32 off" if device.type == "cuda" else "fp32",
        "config": asdict(config),
        "autoencoder_steps": len(losses["autoencoder"]),
        "denoiser_steps": len(losses["denoiser"]),
        "wall_s": round(times.get("autoencoder_s", 0.0) + times.get("denoiser_s", 0.0), 1),
        "autoencoder_s": round(times.get("autoencoder_s", 0.0), 1),
        "cpu_s": round(times.get("autoencoder_cpu_s", 0.0) + times.get("denoiser_cpu_s", 0.0), 1),
        "time_note": "wall_s: both stages' wall time, summed over resumed runs (it includes any time the process "
        "was paused); cpu_s: the process CPU time of the same, which a pause does not count",
        "final_autoencoder_loss": float(np.mean(losses["autoencoder"][-50:])) if losses["autoencoder"] else None,
        "final_loss": float(np.mean(losses["denoiser"][-50:])),
        "final_loss_note": "mean of the last 50 steps' flow-matching MSE",
        "parts": list(PARTS),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
    }
    if config.init is not None and (Path(config.init) / "training.json").exists():
        record["init_training"] = json.loads((Path(config.init) / "training.json").read_text())
    write_bytes(out / "training.json", (json.dumps(record, indent=2) + "\n").encode())
    if config.sample_grid:
        sample_grid(out, out / "samples.png")
    return record

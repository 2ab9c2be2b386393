"""The work of one denoising step of a real model, as data: tokens, FLOPs and message shapes.

A DiT step is a stack of attention layers, one per transformer block. For one layer and one
transformer call, with B images, S = S_txt + S_img tokens (joint attention) and hidden size
d = H heads x D:

    V projection        2 d^2 FLOPs per token               what V-First computes first
    Q, K projections    4 d^2 FLOPs per token               what V's exchange can hide under,
    RMSNorm, RoPE       `qk_passes` read+write passes over Q and K (memory-bound, bytes / HBM)
    attention           4 B S^2 d FLOPs                     (Q K^T and P V)
    the rest            `rest_flops` d^2 FLOPs per token    output projection and MLP

A linear layer in -> out costs 2 x tokens x in x out FLOPs. Timestep modulation (B rows),
embedders and the final projection (<1% of the FLOPs at these sizes) are left out.

Under Ulysses every rank holds split_sizes(S_txt) + split_sizes(S_img) tokens (text and image are
split separately, as `cocodiff.parallel` does) and, after the exchange, split_sizes(H) heads;
a step waits for the slowest rank, so compute uses the largest share (rank 0's). With a ring of
R chunks (ranks = R x U) the tokens are split the same way over all ranks, the heads over U, and
a rank's attention covers its chunk's queries (S / R) against all S keys.

Image tokens = (height / vae_factor / patch) x (width / vae_factor / patch). Classifier-free
guidance doubles the work: as a batch of 2 per call (SD3), or as two calls per step (Qwen-Image).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..sizes import split_sizes

__all__ = ["DTYPES", "LayerKind", "MODELS", "ModelSpec", "Workload", "get_model", "split_sizes"]

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerKind:
    """Blocks of one shape: each has one attention layer."""

    name: str
    count: int
    image_only: bool = False
    """Attention over the image tokens only (SD3.5 Medium's second attention); else text + image."""
    rest_flops: float
    """FLOPs per token, in units of d^2, besides the V/Q/K projections and attention."""
    overlap_flops: float = 0.0
    """Of `rest_flops`, what can run while the attention output travels back (with V-First)."""
    qk_passes: int = 2
    """Read+write passes over Q and K after their projection: RMSNorm (1) and RoPE (1)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    name: str
    source: str
    """Where the configuration comes from."""
    heads: int
    head_dim: int
    layers: tuple[LayerKind, ...]
    text_tokens: int
    vae_factor: int
    patch: int
    """Image tokens per side = pixels / vae_factor / patch (FLUX's 2x2 latent packing counts as patch 2)."""
    out_channels: int
    """Values per image token of the transformer's output (gathered to every rank at the end)."""
    cfg: str
    """Classifier-free guidance: `none` (guidance-distilled), `batch` (a batch of 2 per call), `calls` (2 calls)."""
    default_steps: int
    default_dtype: str = "bf16"
    note: str = ""

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def pixel_multiple(self) -> int:
        return self.vae_factor * self.patch


# FLOPs per token in units of d^2 (a linear d -> k d is 2 k d^2), summed over both streams where a
# block has two (each token is in one stream):
#   FLUX.1 double-stream: QKV 6, to_out 2, MLP d -> 4d -> d 16           -> rest 2 + 16 = 18
#   FLUX.1 single-stream: QKV 6, proj_mlp d -> 4d 8, proj_out 5d -> d 10 -> rest 18, of which the
#                         MLP branch (8) runs under the output exchange (the engine does this)
#   FLUX.2 double-stream: QKV 6, to_out 2, SwiGLU d -> 2x3d 12, 3d -> d 6 -> rest 20
#   FLUX.2 single-stream: fused QKV+MLP-in d -> 3d + 6d (6 + 12), to_out 4d -> d 8 -> rest 20; the
#                         MLP-in columns (12) are assumed split from the fused weight so V comes
#                         first and the MLP branch runs under the output exchange, as in FLUX.1
#   SD3.5 / Qwen-Image joint blocks: QKV 6, out 2, MLP 4x 16             -> rest 18
FLUX1_DOUBLE, FLUX1_SINGLE = 18.0, 18.0
MODELS: dict[str, ModelSpec] = {
    "flux1-dev": ModelSpec(
        name="flux1-dev",
        source="black-forest-labs/FLUX.1-dev transformer config: 19 double + 38 single blocks, 24 heads x 128; "
        "T5 max_sequence_length 512 (FluxPipeline default); 2x2 packed latents of a VAE with factor 8",
        heads=24, head_dim=128,
        layers=(LayerKind(name="double-stream", count=19, rest_flops=FLUX1_DOUBLE),
                LayerKind(name="single-stream", count=38, rest_flops=FLUX1_SINGLE, overlap_flops=8.0)),
        text_tokens=512, vae_factor=8, patch=2, out_channels=64, cfg="none", default_steps=28,
        note="guidance-distilled: one transformer call per step",
    ),
    "sd35-large": ModelSpec(
        name="sd35-large",
        source="stabilityai/stable-diffusion-3.5-large transformer config: 38 joint blocks, 38 heads x 64, "
        "patch 2, VAE factor 8; text = 77 CLIP + 256 T5 tokens (StableDiffusion3Pipeline defaults)",
        heads=38, head_dim=64,
        layers=(LayerKind(name="joint", count=38, rest_flops=18.0, qk_passes=1),),  # QK RMSNorm, no RoPE
        text_tokens=333, vae_factor=8, patch=2, out_channels=64, cfg="batch", default_steps=28,
        note="CFG as a batch of 2 per call; the last block's text stream (context_pre_only) is counted in full",
    ),
    "qwen-image": ModelSpec(
        name="qwen-image",
        source="Qwen/Qwen-Image (diffusers QwenImageTransformer2DModel defaults: 60 blocks, 24 heads x 128, "
        "patch 2; VAE factor 8); text tokens: 256, an assumed typical prompt length (it varies per prompt)",
        heads=24, head_dim=128,
        layers=(LayerKind(name="dual-stream", count=60, rest_flops=18.0),),
        text_tokens=256, vae_factor=8, patch=2, out_channels=64, cfg="calls", default_steps=50,
        note="true CFG with a negative prompt: two transformer calls per step",
    ),
    "flux2-dev": ModelSpec(
        name="flux2-dev",
        source="diffusers 0.42.1 Flux2Transformer2DModel defaults: 8 double + 48 single blocks, 48 heads x 128, "
        "mlp_ratio 3 (SwiGLU), in_channels 128 = 32 latent channels packed 2x2; Flux2Pipeline: "
        "max_sequence_length 512, VAE factor 8 (4 block_out_channels)",
        heads=48, head_dim=128,
        layers=(LayerKind(name="double-stream", count=8, rest_flops=20.0),
                LayerKind(name="single-stream", count=48, rest_flops=20.0, overlap_flops=12.0)),
        text_tokens=512, vae_factor=8, patch=2, out_channels=128, cfg="none", default_steps=50,
        note="guidance-distilled: one transformer call per step",
    ),
    # The repository's presets (cocodiff/presets.py), run by `bench e2e` on the emulated clusters. Written
    # out here so the simulator needs no torch; tests/test_models.py checks them against the real pipelines.
    "tiny-flux": ModelSpec(
        name="tiny-flux",
        source="cocodiff/presets.py _build_flux: FluxTransformer2DModel 2 double + 2 single blocks, 4 heads x 32, "
        "11 text tokens; AutoencoderKL with 3 down-samplings (factor 8) and FLUX's 2x2 packing",
        heads=4, head_dim=32,
        layers=(LayerKind(name="double-stream", count=2, rest_flops=FLUX1_DOUBLE),
                LayerKind(name="single-stream", count=2, rest_flops=FLUX1_SINGLE, overlap_flops=8.0)),
        text_tokens=11, vae_factor=8, patch=2, out_channels=64, cfg="none", default_steps=4, default_dtype="fp32",
    ),
    "tiny-shapes": ModelSpec(
        name="tiny-shapes",
        source="cocodiff/shapes/model.py: FluxTransformer2DModel 2 double + 4 single blocks, 4 heads x 32, "
        "12 text tokens; AutoencoderKL with one down-sampling (factor 2) and FLUX's 2x2 packing; true CFG",
        heads=4, head_dim=32,
        layers=(LayerKind(name="double-stream", count=2, rest_flops=FLUX1_DOUBLE),
                LayerKind(name="single-stream", count=4, rest_flops=FLUX1_SINGLE, overlap_flops=8.0)),
        text_tokens=12, vae_factor=2, patch=2, out_channels=16, cfg="calls", default_steps=20, default_dtype="fp32",
    ),
    "tiny-sd3": ModelSpec(
        name="tiny-sd3",
        source="cocodiff/presets.py _build_sd3: 3 joint blocks, 6 heads x 16, block 0 with a second image-only "
        "attention, patch 2, 11 text tokens, VAE factor 8",
        heads=6, head_dim=16,
        layers=(LayerKind(name="joint", count=3, rest_flops=18.0, qk_passes=1),
                LayerKind(name="image-only", count=1, image_only=True, rest_flops=2.0, qk_passes=1)),
        text_tokens=11, vae_factor=8, patch=2, out_channels=64, cfg="batch", default_steps=4, default_dtype="fp32",
    ),
    "tiny-qwen-image": ModelSpec(
        name="tiny-qwen-image",
        source="cocodiff/presets.py _build_qwen_image: 2 blocks, 5 heads x 16, patch 2, 11 text tokens, "
        "AutoencoderKLQwenImage with 3 down-samplings (factor 8)",
        heads=5, head_dim=16,
        layers=(LayerKind(name="dual-stream", count=2, rest_flops=18.0),),
        text_tokens=11, vae_factor=8, patch=2, out_channels=64, cfg="calls", default_steps=4, default_dtype="fp32",
    ),
}


def get_model(name: str) -> ModelSpec:
    if name not in MODELS:
        raise UsageError(f"--model {name!r} is not one of {', '.join(MODELS)}")
    return MODELS[name]


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """One model at one size: what a denoising step computes and sends."""

    model: ModelSpec
    height: int
    width: int
    batch: int = 1
    dtype: str = "bf16"
    steps: int = 28
    cfg: bool = True
    """Apply the model's classifier-free guidance (`ModelSpec.cfg`)."""

    def __post_init__(self) -> None:
        m = self.model.pixel_multiple
        for side, value in (("height", self.height), ("width", self.width)):
            if value < m or value % m:
                raise UsageError(
                    f"{side} {value} is not a positive multiple of {m} (VAE factor {self.model.vae_factor} "
                    f"x patch {self.model.patch}) for {self.model.name}"
                )
        if self.batch < 1:
            raise UsageError(f"--batch {self.batch} must be at least 1")
        if self.steps < 1:
            raise UsageError(f"--steps {self.steps} must be at least 1")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    @property
    def image_tokens(self) -> int:
        m = self.model.pixel_multiple
        return (self.height // m) * (self.width // m)

    @property
    def text_tokens(self) -> int:
        return self.model.text_tokens

    @property
    def item_bytes(self) -> int:
        return DTYPES[self.dtype]

    @property
    def call_batch(self) -> int:
        """Images per transformer call (B): doubled by CFG done as a batch."""
        return self.batch * (2 if self.cfg and self.model.cfg == "batch" else 1)

    @property
    def calls_per_step(self) -> int:
        return 2 if self.cfg and self.model.cfg == "calls" else 1

    def tokens(self, kind: LayerKind) -> int:
        """S of one attention layer of this kind."""
        return self.image_tokens if kind.image_only else self.image_tokens + self.text_tokens

    def token_split(self, kind: LayerKind, ranks: int) -> list[int]:
        """Tokens each rank holds before the exchange (text and image split separately)."""
        image = split_sizes(self.image_tokens, ranks)
        if kind.image_only:
            return image
        return [t + i for t, i in zip(split_sizes(self.text_tokens, ranks), image)]

    def head_split(self, ranks: int) -> list[int]:
        return split_sizes(self.model.heads, ranks)

    def chunk_tokens(self, kind: LayerKind, ranks: int, ring: int) -> list[int]:
        """Tokens of each ring chunk: its Ulysses ranks' shares (ranks are chunk-major)."""
        tokens, ulysses = self.token_split(kind, ranks), ranks // ring
        return [sum(tokens[g * ulysses : (g + 1) * ulysses]) for g in range(ring)]

    def flops(self, kind: LayerKind, ranks: int, ring: int = 1) -> dict[str, float]:
        """FLOPs (and bytes for the memory-bound part) of the slowest rank, one layer, one call.

        Keys: `v` (V projection), `qk` (Q, K projections), `qk_bytes` (RMSNorm and RoPE memory
        traffic, bytes), `attention`, `rest` (output projection and MLP), `overlap` (the part of
        `rest` that may run under the output exchange).

        With a ring of `ring` chunks (Ulysses over ranks / ring), a rank attends its chunk's
        queries for its ranks / ring share of the heads to every chunk's keys, one block per
        ring step.
        """
        d, B = self.model.hidden, self.call_batch
        tokens = max(self.token_split(kind, ranks))
        S = self.tokens(kind)
        queries = S if ring == 1 else max(self.chunk_tokens(kind, ranks, ring))
        heads = max(self.head_split(ranks // ring))
        return {
            "v": 2.0 * d * d * B * tokens,
            "qk": 4.0 * d * d * B * tokens,
            "qk_bytes": kind.qk_passes * 2 * 2 * B * tokens * d * self.item_bytes,  # Q and K, read + write
            "attention": 4.0 * B * queries * S * self.model.head_dim * heads,
            "rest": kind.rest_flops * d * d * B * tokens,
            "overlap": kind.overlap_flops * d * d * B * tokens,
        }

    def describe(self) -> str:
        cfg = {"none": "no CFG", "batch": "CFG batch x2", "calls": "CFG 2 calls/step"}[self.model.cfg if self.cfg else "none"]
        return (f"{self.model.name} {self.height}x{self.width}, batch {self.batch}, {self.dtype}, {self.steps} steps, "
                f"{self.image_tokens} image + {self.text_tokens} text tokens, {cfg}")

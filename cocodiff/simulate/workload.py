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
split separately, as `cocodiff.engine.parallelize` does) and, after the exchange, split_sizes(H) heads;
a step waits for the slowest rank, so compute uses the largest share (rank 0's). With a ring of
R chunks (ranks = R x U) the tokens are split the same way over all ranks, the heads over U, and
a rank's attention covers its chunk's queries (S / R) against all S keys.

Image tokens = (height / vae_factor / patch) x (width / vae_factor / patch), times the latent
frames of a video ((frames - 1) // temporal factor + 1). Classifier-free guidance doubles the
work: as a batch of 2 per call (SD3), or as two calls per step (Qwen-Image, Wan).

Cross-attention (video models; `LayerKind.cross`) has queries S_q (the video tokens) and keys
S_kv (the text): projections 2 d^2 per query token (Q) and 4 d^2 per text token (K, V), attention
4 B S_q S_kv d. `local` (Wan): a rank attends its own queries with all heads to the whole text,
which it projects itself; nothing is exchanged. `exchanged` (LTX-Video): the text is split over
the ranks like the queries and both go through the exchange (V: text, Q+K: video + text, O: video).

A displaced patch (`Patch`, `+patches=M`, engine/patches.py) is one of M contiguous pieces of
the image's tokens (the largest: split_sizes(S_img, M)[0]) with the whole text (`whole`, the
engine's default) or its piece of the text (`patched`): its queries, projections, exchanges and
output are the patch's tokens, its keys the whole sequence's (this step's or the last's, from the
K/V buffer: nothing more is sent or projected for them).

The model data (`MODELS`, `ModelSpec`, `LayerKind`) lives in specs.py and is re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import UsageError
from ..config.sizes import split_sizes
from ..models.catalog import DTYPES, MODELS, LayerKind, ModelSpec, frame_form, get_model

__all__ = ["DTYPES", "LayerKind", "MODELS", "ModelSpec", "PATCH_TEXT", "Patch", "Workload", "get_model", "split_sizes"]

PATCH_TEXT = ("whole", "patched")
"""How a displaced patch carries the text (engine/patches.py, `--pipe-text`)."""


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
    frames: int | None = None
    """Video frames (None: the model's default; 1 for image models, the only value they take)."""

    def __post_init__(self) -> None:
        m = self.model.pixel_multiple
        for side, value in (("height", self.height), ("width", self.width)):
            if value < m or value % m:
                raise UsageError(
                    f"{side} {value} is not a positive multiple of {m} (VAE factor {self.model.vae_factor} "
                    f"x patch {self.model.patch}) for {self.model.name}"
                )
        if self.frames is None:
            object.__setattr__(self, "frames", self.model.default_frames)
        t = self.model.temporal_factor
        if not self.model.video and self.frames != 1:
            raise UsageError(f"--frames {self.frames}: {self.model.name} makes images, not videos")
        form = frame_form(self.frames, t, self.model.frame_chunk)
        if form is not None:
            raise UsageError(f"--frames {self.frames} must be {form} (..., {self.model.default_frames}) for "
                             f"{self.model.name} (the frames its VAE makes)")
        if self.batch < 1:
            raise UsageError(f"--batch {self.batch} must be at least 1")
        if self.steps < 1:
            raise UsageError(f"--steps {self.steps} must be at least 1")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    @property
    def latent_frames(self) -> int:
        return self.model.latent_frames(self.frames)

    @property
    def image_tokens(self) -> int:
        """Tokens of the image, or of the whole video (all latent frames)."""
        m = self.model.pixel_multiple
        return self.latent_frames * (self.height // m) * (self.width // m)

    @property
    def text_tokens(self) -> int:
        """Text tokens in the joint sequence (0 where text enters by cross-attention only)."""
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
        """S of one attention layer of this kind (its queries: the video's, for cross-attention)."""
        if kind.image_only or kind.cross:
            return self.image_tokens
        if kind.text_only:
            return self.text_tokens
        return self.image_tokens + self.text_tokens

    def key_tokens(self, kind: LayerKind) -> int:
        """Keys of one attention layer of this kind: the text for cross-attention, else `tokens`."""
        return self.model.cross_tokens if kind.cross else self.tokens(kind)

    def token_split(self, kind: LayerKind, ranks: int) -> list[int]:
        """Tokens (queries) each rank holds before the exchange (text and image split separately)."""
        image = split_sizes(self.image_tokens, ranks)
        if kind.image_only or kind.cross:
            return image
        text = split_sizes(self.text_tokens, ranks)
        if kind.text_only:
            return text
        return [t + i for t, i in zip(text, image)]

    def key_split(self, kind: LayerKind, ranks: int) -> list[int]:
        """Key (and value) tokens each rank projects: the whole text on every rank for local
        cross-attention, a share of it for exchanged cross-attention, else `token_split`."""
        if kind.cross == "local":
            return [self.model.cross_tokens] * ranks
        if kind.cross == "exchanged":
            return split_sizes(self.model.cross_tokens, ranks)
        return self.token_split(kind, ranks)

    def head_split(self, ranks: int) -> list[int]:
        return split_sizes(self.model.heads, ranks)

    def chunk_tokens(self, kind: LayerKind, ranks: int, ring: int, keys: bool = False) -> list[int]:
        """Tokens of each ring chunk (queries, or with `keys` the keys): its Ulysses ranks' shares
        (ranks are chunk-major)."""
        tokens, ulysses = (self.key_split if keys else self.token_split)(kind, ranks), ranks // ring
        return [sum(tokens[g * ulysses : (g + 1) * ulysses]) for g in range(ring)]

    def flops(self, kind: LayerKind, ranks: int, ring: int = 1) -> dict[str, float]:
        """FLOPs (and bytes for the memory-bound part) of the slowest rank, one layer, one call.

        Keys: `v` (V projection), `qk` (Q, K projections), `qk_bytes` (RMSNorm and RoPE memory
        traffic, bytes), `attention`, `rest` (output projection and MLP), `overlap` (the part of
        `rest` that may run under the output exchange).

        With a ring of `ring` chunks (Ulysses over ranks / ring), a rank attends its chunk's
        queries for its ranks / ring share of the heads to every chunk's keys, one block per
        ring step. Local cross-attention has no exchange: a rank's own queries, all heads, every key.
        """
        d, B = self.model.hidden, self.call_batch
        queries, keys = max(self.token_split(kind, ranks)), max(self.key_split(kind, ranks))
        S_kv = self.key_tokens(kind)
        if kind.cross == "local":
            attended, heads = queries, self.model.heads
        else:
            attended = self.tokens(kind) if ring == 1 else max(self.chunk_tokens(kind, ranks, ring))
            heads = max(self.head_split(ranks // ring))
        return {
            "v": 2.0 * d * d * B * keys,
            "qk": 2.0 * d * d * B * (queries + keys),
            "qk_bytes": kind.qk_passes * 2 * B * (queries + keys) * d * self.item_bytes,  # Q and K, read + write
            "attention": 4.0 * B * attended * S_kv * self.model.head_dim * heads,
            "rest": kind.rest_flops * d * d * B * queries,
            "overlap": kind.overlap_flops * d * d * B * queries,
        }

    def describe(self) -> str:
        cfg = {"none": "no CFG", "batch": "CFG batch x2", "calls": "CFG 2 calls/step"}[self.model.cfg if self.cfg else "none"]
        if not self.model.video:
            return (f"{self.model.name} {self.height}x{self.width}, batch {self.batch}, {self.dtype}, {self.steps} steps, "
                    f"{self.image_tokens} image + {self.text_tokens} text tokens, {cfg}")
        text = (f"{self.model.cross_tokens} text tokens by cross-attention "
                f"({'local: nothing exchanged' if any(k.cross == 'local' for k in self.model.layers) else 'exchanged'})"
                if self.model.cross_tokens else f"{self.text_tokens} text tokens")
        return (f"{self.model.name} {self.height}x{self.width} x {self.frames} frames ({self.latent_frames} latent), "
                f"batch {self.batch}, {self.dtype}, {self.steps} steps, {self.image_tokens} video tokens + {text}, {cfg}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Patch(Workload):
    """One displaced patch of a workload's step (the module's docstring): the patch's tokens are
    the queries, the whole sequence the keys."""

    patches: int
    text: str = "whole"

    @classmethod
    def of(cls, workload: Workload, patches: int, text: str = "whole") -> Patch:
        return cls(**{f.name: getattr(workload, f.name) for f in fields(Workload)}, patches=patches, text=text)

    def __post_init__(self) -> None:
        Workload.__post_init__(self)
        if self.patches < 1 or self.text not in PATCH_TEXT:
            raise ValueError(f"Patch: patches {self.patches} must be at least 1, text one of {', '.join(PATCH_TEXT)}")

    @property
    def image_tokens(self) -> int:
        return split_sizes(self.whole_image_tokens, self.patches)[0]

    @property
    def text_tokens(self) -> int:
        text = self.model.text_tokens
        return text if self.text == "whole" else split_sizes(text, self.patches)[0]

    @property
    def whole_image_tokens(self) -> int:
        return Workload.image_tokens.fget(self)

    def key_tokens(self, kind: LayerKind) -> int:
        """The whole sequence's keys (the K/V buffer's), whatever the patch."""
        if kind.cross:
            return self.model.cross_tokens
        image, text = self.whole_image_tokens, self.model.text_tokens
        return image if kind.image_only else text if kind.text_only else image + text

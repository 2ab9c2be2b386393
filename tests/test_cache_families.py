"""Step caches on every family's blocks: text-first pairs (FLUX.1, SD3, Qwen-Image), image-first
pairs (HunyuanVideo 1.5), LTX-2's video and audio (the text unchanged beside them), one tensor
(Wan, LTX-Video) and FLUX.2's single-stream blocks, whose one sequence the model joins from the two
streams between its block lists."""

import pytest
import torch

from cocodiff.engine.cache import parse_cache
from cocodiff.engine.cache.steps import apply_cache
from cocodiff.models.presets import PRESETS, load_pipeline

TOKENS = 6  # image and text tokens alike: streams read in the wrong order would still add up


class PairBlock(torch.nn.Module):
    """Adds a fixed vector to each stream: a middle's residual is the same at every step, so a
    skipped step reused it exactly; returns the streams in `order`."""

    def __init__(self, seed: int, order: tuple[str, str]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.image, self.text, self.order = torch.randn(4, generator=g), torch.randn(4, generator=g), order

    def forward(self, hidden_states, encoder_hidden_states, temb=None):
        streams = {"img": hidden_states + self.image, "txt": encoder_hidden_states + self.text}
        return streams[self.order[0]], streams[self.order[1]]


class HunyuanVideo15Transformer3DModel(torch.nn.Module):
    """HunyuanVideo 1.5's block protocol (its family's `block_outputs`): (image, text)."""

    order = ("img", "txt")

    def __init__(self) -> None:
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList(PairBlock(seed, self.order) for seed in range(4))

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        text, temb = encoder_hidden_states, timestep / 1000
        for block in self.transformer_blocks:
            out = block(hidden_states=hidden_states, encoder_hidden_states=text, temb=temb)
            named = dict(zip(self.order, out))
            hidden_states, text = named["img"], named["txt"]
        return torch.cat([text, hidden_states], dim=1)


class TextFirst(HunyuanVideo15Transformer3DModel):
    """The same blocks returning (text, image), as FLUX's do (no family record: text first)."""

    order = ("txt", "img")


class AudioBlock(torch.nn.Module):
    """LTX-2's block protocol: the video and the audio streams in and out (video first), the text
    read by cross-attention and never changed; each stream gets a fixed vector."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.video, self.audio = torch.randn(4, generator=g), torch.randn(4, generator=g)

    def forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, temb=None):
        return hidden_states + self.video + encoder_hidden_states.mean(), audio_hidden_states + self.audio


class LTX2VideoTransformer3DModel(torch.nn.Module):
    """LTX-2's family record: its streams are `hidden_states` and `audio_hidden_states` (`block_streams`)."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList(AudioBlock(seed) for seed in range(4))

    def forward(self, hidden_states, encoder_hidden_states, timestep):
        audio, temb = hidden_states.flip(1), timestep / 1000
        for block in self.transformer_blocks:
            hidden_states, audio = block(hidden_states, audio, encoder_hidden_states=encoder_hidden_states, temb=temb)
        return torch.cat([audio, hidden_states], dim=1)


@pytest.mark.parametrize("model_class", [HunyuanVideo15Transformer3DModel, TextFirst, LTX2VideoTransformer3DModel])
def test_a_skipped_step_reuses_each_stream_in_its_family_order(model_class):
    model = model_class()
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(2, TOKENS, 4, generator=g), torch.randn(2, TOKENS, 4, generator=g)
    steps = [torch.tensor([1000.0 - 10 * s]) for s in range(3)]
    plain = [model(x, text, t) for t in steps]
    cache = apply_cache(model, parse_cache("fbcache:1e9"))  # every step after the first skips its middle
    cached = [model(x, text, t) for t in steps]
    cache.undo()
    assert cache.report()["skipped_steps"] == 2
    for a, b in zip(plain, cached):  # the middle adds the same every step: reused, it is exact
        assert (a - b).abs().max() < 1e-5, (a - b).abs().max()


FAMILIES = ["tiny-flux2", "tiny-wan", "tiny-wan22", "tiny-ltx", "tiny-hunyuanvideo15", "tiny-flux", "tiny-ltx2"]
SKIPS = {"tiny-flux2": (1, 3), "tiny-wan": (2, 6), "tiny-wan22": (2, 2), "tiny-ltx": (1, 3), "tiny-hunyuanvideo15": (2, 6),
         "tiny-flux": (1, 3), "tiny-ltx2": (3, 9)}
"""(computed, skipped) transformer calls of `fbcache:1e9` over 4 steps, per family (tiny-ltx2: three
calls a step, its guidance's)."""


@pytest.mark.parametrize("model", FAMILIES)
def test_every_family_runs_a_step_cache_and_skips(model):
    """`generate --cache fbcache:1e9 --nproc 1 --steps 4` on each family: every step after the first
    skips its middle blocks, and the run finishes with finite latents close to the uncached run's."""
    preset = PRESETS[model]
    pipe, _ = load_pipeline(model, seed=0)
    pipe.set_progress_bar_config(disable=True)
    size = preset.pixel_multiple * 2
    options = dict(height=size, width=size, num_inference_steps=4, output_type="latent")
    if preset.frames:
        options["num_frames"] = 1 + (preset.frames - 1) // 2
    run = lambda: pipe("a red circle", generator=torch.Generator().manual_seed(0), **options)  # noqa: E731
    plain = run()
    cache = apply_cache(pipe.transformer, parse_cache("fbcache:1e9"), scheduler=pipe.scheduler)
    cached = run()
    cache.undo()
    plain, cached = (getattr(out, "frames", None) if getattr(out, "frames", None) is not None else out.images
                     for out in (plain, cached))
    report = cache.report()
    # Every call after the first step's skips: 1 or 2 calls a step (CFG), 4 steps (Wan 2.2's first
    # expert, the one cached here, runs 2 of them).
    assert (report["computed_steps"], report["skipped_steps"]) == SKIPS[model], report
    assert torch.isfinite(cached).all()
    # LOSSY, but the same picture's latents: measured 0.0006 (tiny-wan22) to 0.076 (tiny-hunyuanvideo15) and
    # 0.17 (tiny-ltx2, whose three guidance terms a step scale up what a skipped step misses); the PSNR
    # floors are the matrix's.
    assert (cached - plain).abs().max() <= 0.2 * plain.abs().max()


def test_a_class_with_no_record_has_its_blocks_stream_order_read_from_their_forward():
    """A transformer whose plan is inferred has no family record to say in which order its blocks return
    their two streams: the cache reads it from their `forward`'s returns. Read so, the blocks of every
    class with a record give the order that record writes, and CogView4's (no record) gives image first."""
    import inspect

    import diffusers

    from cocodiff.engine.cache.steps import cache_blocks, returned_order
    from cocodiff.engine.families import FAMILIES

    streams = ("hidden_states", "encoder_hidden_states")
    read = 0
    for name, family in FAMILIES.items():
        if family.block_streams != streams:
            continue  # LTX-2: its video and audio, under names of their own
        module = inspect.getmodule(getattr(diffusers, name))
        blocks = [cls for cls in vars(module).values() if isinstance(cls, type) and cls.__name__.endswith("Block")
                  and issubclass(cls, torch.nn.Module) and returned_order(cls, streams) not in (None, "one")]
        assert all(returned_order(cls, streams) == family.block_outputs[0] for cls in blocks), name
        read += len(blocks)
    assert read >= 5  # FLUX.1 (both kinds), SD3, Qwen-Image, HunyuanVideo 1.5
    transformer = load_pipeline("tiny-cogview4")[0].transformer
    assert {returned_order(type(b), streams) for b in cache_blocks(transformer)} == {"img"}

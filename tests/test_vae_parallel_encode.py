"""Patch-parallel VAE encode equals the whole encode (the seam test), and the runs that take an
image input encode it in bands.

A random image through a small AutoencoderKL (3 downsamples: x8, GroupNorm everywhere, with and
without the FLUX.1 VAE's mid-block attention) and a small AutoencoderKLFlux2, encoded in bands on 2
and 4 ranks and whole in one process. Every 3x3 convolution borrows its padding rows from the neighbouring bands, every
downsample the first row of the band below, GroupNorm takes the whole image's statistics and the
attention every rank's K/V, so only the order of sums differs: fp32 rounding (~1e-7 per operation)
over ~20 layers, well inside 1e-5 of the moments' magnitude, while a band's edge convolved over
zero rows instead of its neighbour's, or normalized with its own statistics, is off by 1e-2 or more.
"""


import pytest
import torch
from conftest import RANK_TIMEOUT_S

from cocodiff.run.launch import spawn

RTOL_OF_SCALE = 1e-5
IMAGE = (1, 3, 120, 32)  # (B, 3, H, W): 15 x 4 latents, uneven bands of 8 + 7 / 4 + 4 + 4 + 3 latent rows


VAES = ("presets", "mid-attention", "flux2")
"""The presets' AutoencoderKL; with the FLUX.1 VAE's mid-block attention; FLUX.2's (the same encoder,
its latent batch norm is the pipeline's, after the encode)."""


def small_vae(kind: str):
    from diffusers import AutoencoderKL, AutoencoderKLFlux2

    torch.manual_seed(0)
    cls = AutoencoderKLFlux2 if kind == "flux2" else AutoencoderKL
    return cls(
        block_out_channels=(8, 16, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, latent_channels=4,
        norm_num_groups=8, mid_block_add_attention=kind != "presets",
    ).eval()


def image() -> torch.Tensor:
    return torch.rand(*IMAGE, generator=torch.Generator().manual_seed(1)) * 2 - 1  # in [-1, 1], as the pipelines give


def encode_in_bands(kinds: tuple[str, ...]) -> list[dict]:
    """Each VAE's encode through `encode_split` on this rank: its moments, a sample, and the rows
    its encoder saw (a band, not the image)."""
    from cocodiff.engine.vae.kl2d import encode_split

    results = []
    for kind in kinds:
        vae = small_vae(kind)
        rows: list[int] = []
        vae.encoder.register_forward_pre_hook(lambda _module, args: rows.append(args[0].shape[-2]))
        with torch.no_grad(), encode_split(vae, None) as encoded:
            posterior = vae.encode(image()).latent_dist
            sample = posterior.sample(torch.Generator().manual_seed(2))
        results.append({"moments": posterior.parameters, "sample": sample, "rows": rows, "encoded": len(encoded)})
    return results


@pytest.mark.parametrize(("nproc", "kinds"), [
    (2, ("mid-attention",)),  # every kind of module the others have, and the attention
    pytest.param(4, VAES, marks=pytest.mark.slow),
])
def test_band_encode_equals_whole(nproc, kinds):
    ranks = spawn(encode_in_bands, nproc, kinds, timeout_s=RANK_TIMEOUT_S)
    latent_rows = IMAGE[2] // 8
    bands = [latent_rows // nproc + (1 if r < latent_rows % nproc else 0) for r in range(nproc)]
    for i, kind in enumerate(kinds):
        with torch.no_grad():
            whole = small_vae(kind).encode(image()).latent_dist
            sample = whole.sample(torch.Generator().manual_seed(2))
        scale = whole.parameters.abs().max()
        for rank, results in enumerate(ranks):  # every rank ends with the whole moments
            got = results[i]
            assert got["rows"] == [8 * bands[rank]] and got["encoded"] == 1, kind  # its own band, once
            assert got["moments"].shape == whole.parameters.shape
            assert (got["moments"] - whole.parameters).abs().max() <= RTOL_OF_SCALE * scale, kind
            assert (got["sample"] - sample).abs().max() <= RTOL_OF_SCALE * sample.abs().max()


def inpainting_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """A flat picture (a red ellipse on blue, 64 x 64: 8 latent rows, 4 a rank) and its masked copy
    (a white bottom-right square: zeros there), as the inpainting pipelines make them: diffusers'
    image processor gives a (1, 3, H, W) view of (H, W, 3) pixels, channels-last strides."""
    import numpy as np
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    rows, columns = np.mgrid[:64, :64]
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    pixels[...] = (30, 60, 200)
    pixels[((rows - 28) / 20) ** 2 + ((columns - 30) / 14) ** 2 <= 1] = (220, 40, 30)
    mask = np.zeros((64, 64), dtype=np.uint8)
    mask[36:60, 36:60] = 255
    image = VaeImageProcessor(vae_scale_factor=8).preprocess(Image.fromarray(pixels))
    mask = VaeImageProcessor(vae_scale_factor=8, do_normalize=False, do_binarize=True,
                             do_convert_grayscale=True).preprocess(Image.fromarray(mask))
    image = image.contiguous(memory_format=torch.channels_last)  # what the processor gives, pinned
    return image, image * (mask < 0.5)


def encode_inpainting_inputs() -> list[torch.Tensor]:
    """Both encodes of an inpainting run (the image, the masked image) in bands on this rank: the
    moments, with the VAE prepared as a run loads it."""
    from cocodiff.engine.vae import prepare
    from cocodiff.engine.vae.kl2d import encode_split

    vae = small_vae("presets")
    prepare(vae)
    with torch.no_grad(), encode_split(vae, None):
        return [vae.encode(x).latent_dist.parameters for x in inpainting_inputs()]


def test_band_encode_of_an_inpainting_run_equals_the_whole_encode():
    """The whole encode (one process) of a flat image and of its masked copy, channels-last as the
    pipelines give them, equals the band encode: on the CPU, GroupNorm's channels-last kernel takes
    the variance as E[x^2] - E[x]^2 in float32, ~1e-4 of the moments' scale off where a group's mean
    is large against its spread (the background, the masked zeros), unless the VAE takes its input
    contiguous (`prepare`), as the band GroupNorm's exact statistics do."""
    from cocodiff.engine.vae import prepare

    ranks = spawn(encode_inpainting_inputs, 2, timeout_s=RANK_TIMEOUT_S)
    vae = small_vae("presets")
    prepare(vae)
    with torch.no_grad():
        wholes = [vae.encode(x).latent_dist.parameters for x in inpainting_inputs()]
    for name, whole, *bands in zip(("image", "masked image"), wholes, *ranks):
        scale = whole.abs().max()
        for got in bands:
            assert (got - whole).abs().max() <= RTOL_OF_SCALE * scale, name


def test_encode_is_refused_for_a_vae_without_the_2d_encoder():
    from cocodiff.errors import UsageError
    from cocodiff.engine.vae import use_parallel_encode

    class Other:
        pass

    assert use_parallel_encode("on", small_vae("presets")) and not use_parallel_encode("auto", Other())
    with pytest.raises(UsageError, match="--parallel-vae on: Other does not encode in bands"):
        use_parallel_encode("on", Other())


# `verify` with the image (and the masked image) encoded in bands on 2 ranks: the matrix's img2img and
# inpaint columns, whose evidence requires 1 and 2 encodes in bands where the VAE splits.

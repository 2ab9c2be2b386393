"""Patch-parallel VAE decode equals the whole decode (the seam test).

Random latents through a small AutoencoderKL (the presets' VAE shape, with and without the
mid-block attention the FLUX.1 VAE has), decoded in bands on 2 and 4 ranks and whole in one
process. Every convolution borrows its padding rows from the neighbouring bands, GroupNorm takes
the whole image's statistics and the attention every rank's K/V, so only the order of sums
differs: fp32 rounding (~1e-7 per operation) over ~30 layers, well inside 1e-5 of the output's
magnitude, while a band's edge convolved over zero rows instead of its neighbour's, or normalized
with its own statistics, is off by 1e-2 or more.
"""

import pytest
import torch
from conftest import RANK_TIMEOUT_S

from cocodiff.run.launch import spawn

RTOL_OF_SCALE = 1e-5
LATENT = (1, 4, 15, 8)  # (B, C, h, w): uneven bands of 8 + 7 / 4 + 4 + 4 + 3 rows on 2 / 4 ranks


def small_vae(attention: bool):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(8, 16, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, latent_channels=LATENT[1],
        norm_num_groups=8, mid_block_add_attention=attention,
    ).eval()


def latents() -> torch.Tensor:
    return torch.randn(*LATENT, generator=torch.Generator().manual_seed(1))


def decode_in_bands(attention: bool) -> torch.Tensor:
    from cocodiff.engine.vae.kl2d import parallel_decode

    with torch.no_grad():
        return parallel_decode(small_vae(attention), latents(), None)


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("attention", [False, True], ids=["presets", "mid-attention"])
def test_band_decode_equals_whole(nproc, attention):
    with torch.no_grad():
        whole = small_vae(attention).decode(latents()).sample
    ranks = spawn(decode_in_bands, nproc, attention, timeout_s=RANK_TIMEOUT_S)
    for sample in ranks:  # every rank ends with the whole image
        assert sample.shape == whole.shape
        assert (sample - whole).abs().max() <= RTOL_OF_SCALE * whole.abs().max()



def test_auto_splits_where_bands_own_twice_the_borrowed_rows():
    from cocodiff.engine.vae import use_parallel_vae

    # Each convolution borrows 1 row of each neighbour: bands of 2 own rows are worth splitting
    # (a 64 px tiny image on 4 ranks), of 1 not; `on` splits down to 1 row a rank.
    vae = small_vae(False)
    assert use_parallel_vae("auto", vae, 8, 4) and not use_parallel_vae("auto", vae, 7, 4)
    assert use_parallel_vae("on", vae, 4, 4) and not use_parallel_vae("off", vae, 64, 4)

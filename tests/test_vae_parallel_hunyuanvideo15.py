"""Patch-parallel decode of the HunyuanVideo 1.5 VAE equals the whole decode (the seam test).

Random latents through a small AutoencoderKLHunyuanVideo15 (the tiny-hunyuanvideo15 preset's
layout), decoded in bands and whole in one process. Each convolution takes its neighbours' rows
(the image's edge rows replicated at its top and bottom, as the stock padding) and the mid-block's
frame-causal attention attends to every band's K/V, so only the order of sums differs: fp32
rounding (~1e-7 per operation) over ~25 layers, well inside 1e-5 of the output's magnitude, while
a band padded with its own edge rows at its cut edges, or attending only to its own rows, is off
by 1e-2 or more. One rank in process checks the band modules; spawned ranks are slow.
"""


import pytest
import torch
from conftest import RANK_TIMEOUT_S

from cocodiff.run.launch import spawn
from cocodiff.config.sizes import split_sizes

RTOL_OF_SCALE = 1e-5
LATENT = (1, 4, 3, 4, 3)  # (B, C, F, h, w): 3 latent frames -> 9; 16 pixels a latent row; 2 rows a band on 2 ranks


def small_vae():
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=LATENT[1], block_out_channels=(8, 8, 16, 16, 16),
                                      layers_per_block=1).eval()  # the tiny-hunyuanvideo15 preset's
    with torch.no_grad():  # the default init leaves the RMS norms at 1: stir everything
        for p in vae.decoder.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return vae


def latents() -> torch.Tensor:
    return torch.randn(*LATENT, generator=torch.Generator().manual_seed(1))


def whole_decode() -> torch.Tensor:
    with torch.no_grad():
        return small_vae().decode(latents()).sample


def decode_in_bands() -> tuple[torch.Tensor, list[int]]:
    """On each rank: its band decode (the clip on rank 0) and the latent rows its decoder was given."""
    from cocodiff.engine.vae.hunyuanvideo15 import parallel_decode

    vae, seen = small_vae(), []
    vae.decoder.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[-2]))
    with torch.no_grad():
        return parallel_decode(vae, latents(), None), seen


def test_band_modules_equal_the_stock_ones_on_one_rank(one_rank):
    """In process: the band's convolutions (replicated edges), attention and the disabled tiling."""
    from cocodiff.engine.vae.hunyuanvideo15 import parallel_decode

    vae = small_vae()
    vae.enable_tiling(32, 32, tile_latent_min_height=2, tile_latent_min_width=2, tile_overlap_factor=0.5)  # 2-row tiles
    with torch.no_grad():
        band = parallel_decode(vae, latents(), None)
    assert vae.use_tiling  # restored
    whole = whole_decode()
    assert (band - whole).abs().max() <= RTOL_OF_SCALE * whole.abs().max()


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def bands(request) -> tuple[int, list[tuple[torch.Tensor, list[int]]]]:
    """Every rank's band decode, once per rank count (4: bands of one latent row)."""
    return request.param, spawn(decode_in_bands, request.param, timeout_s=RANK_TIMEOUT_S)


# Spawning ranks takes ~10 s or more on a loaded 2-core machine.
@pytest.mark.slow
def test_band_decode_equals_whole(bands):
    nproc, ranks = bands
    clip = whole_decode()
    assert clip.shape[2:] == (9, LATENT[-2] * 16, LATENT[-1] * 16)
    assert ranks[0][0].shape == clip.shape  # rank 0 gathers the clip
    assert (ranks[0][0] - clip).abs().max() <= RTOL_OF_SCALE * clip.abs().max()
    sizes = split_sizes(LATENT[-2], nproc)
    for rank in range(1, nproc):  # the other ranks keep their bands
        band = clip[..., 16 * sum(sizes[:rank]):16 * sum(sizes[:rank + 1]), :]
        assert (ranks[rank][0] - band).abs().max() <= RTOL_OF_SCALE * clip.abs().max(), rank


@pytest.mark.slow
def test_each_rank_decodes_only_its_rows(bands):
    nproc, ranks = bands
    assert [seen for _, seen in ranks] == [[n] for n in split_sizes(LATENT[-2], nproc)]


def test_parallel_vae_choice_for_hunyuanvideo15():
    from cocodiff.engine.vae import latent_rows, use_parallel_vae

    vae = small_vae()
    assert latent_rows(vae, 64) == 4  # 16 pixels a latent row
    assert use_parallel_vae("auto", vae, latent_rows=4, world=2)  # two rows per band: each lends one per convolution
    assert not use_parallel_vae("auto", vae, latent_rows=4, world=4)
    assert use_parallel_vae("on", vae, latent_rows=4, world=4)



# `verify --parallel-vae on` on 2 ranks: the matrix's parallel vae column (exact, and decoded in bands).

"""Patch-parallel decode of the Wan video VAE equals the whole decode (the seam test).

Random latents through a small AutoencoderKLWan (the tiny-wan preset's layout: Wan 2.1's, and
Wan 2.2 TI2V's residual up blocks with patch size 2), decoded in bands on 2 ranks and whole in one
process. Each convolution takes its neighbours' rows, the time caches hold the band's rows of the
previous frames and the mid-block attention attends to every band's K/V, so only the order of sums
differs: fp32 rounding (~1e-7 per operation) over ~30 layers, well inside 1e-5 of the output's
magnitude, while a band decoded with zero rows at its cut edges, or attending only to its own
rows, is off by 1e-2 or more. The 2- and 4-rank seam test spawns ranks (slow); one rank in process
checks the band modules (padding, time caches, attention) against the stock ones in the default suite.
"""

import pytest
import torch
from conftest import RANK_TIMEOUT_S

from cocodiff.run.launch import spawn

RTOL_OF_SCALE = 1e-5
LATENT = (1, 4, 3, 6, 4)  # (B, C, F, h, w): 3 latent frames -> 9 (time upsampled twice); 3 rows a band on 2 ranks
LAYOUTS = {
    "wan21": dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
    "wan22": dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1, is_residual=True, patch_size=2, in_channels=12,
                  out_channels=12, scale_factor_spatial=16),
}


def small_vae(layout: str):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(z_dim=LATENT[1], **LAYOUTS[layout]).eval()
    with torch.no_grad():  # the default init leaves the RMS norms at 1 and the biases at 0: stir everything
        for p in vae.decoder.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return vae


def latents() -> torch.Tensor:
    return torch.randn(*LATENT, generator=torch.Generator().manual_seed(1))


def decode_in_bands() -> dict[str, torch.Tensor]:
    from cocodiff.engine.vae.wan import parallel_decode

    with torch.no_grad():
        return {layout: parallel_decode(small_vae(layout), latents(), None) for layout in LAYOUTS}


def test_band_modules_equal_the_stock_ones_on_one_rank(one_rank):
    """In process: the band's convolutions (padding, time caches) and attention, with no neighbour."""
    from cocodiff.engine.vae.wan import parallel_decode

    for layout in LAYOUTS:
        with torch.no_grad():
            whole = small_vae(layout).decode(latents()).sample
            band = parallel_decode(small_vae(layout), latents(), None)
        assert (band - whole).abs().max() <= RTOL_OF_SCALE * whole.abs().max(), layout


# Spawning ranks takes ~10 s or more on a loaded 2-core machine: slow; the test above stays in the default suite.
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])  # 4: bands of 2, 2, 1, 1 latent rows
def test_band_decode_equals_whole(nproc):
    from cocodiff.config.sizes import split_sizes

    with torch.no_grad():
        whole = {layout: small_vae(layout).decode(latents()).sample for layout in LAYOUTS}
    ranks = spawn(decode_in_bands, nproc, timeout_s=RANK_TIMEOUT_S)
    for layout, clip in whole.items():
        assert clip.shape[2] == 9 and clip.shape[-1] == LATENT[-1] * (16 if layout == "wan22" else 8)
        assert ranks[0][layout].shape == clip.shape  # rank 0 gathers the clip
        assert (ranks[0][layout] - clip).abs().max() <= RTOL_OF_SCALE * clip.abs().max(), layout
        factor, sizes = clip.shape[-2] // LATENT[-2], split_sizes(LATENT[-2], nproc)
        for rank in range(1, nproc):  # the other ranks keep their bands
            lo = sum(sizes[:rank]) * factor
            band = clip[..., lo:lo + sizes[rank] * factor, :]
            assert (ranks[rank][layout] - band).abs().max() <= RTOL_OF_SCALE * clip.abs().max(), (layout, rank)


def test_parallel_vae_choice_for_video_vaes():
    from diffusers import AutoencoderKLQwenImage

    from cocodiff.errors import UsageError
    from cocodiff.engine.vae import use_parallel_vae

    wan = small_vae("wan21")
    assert use_parallel_vae("auto", wan, latent_rows=4, world=2)  # two rows per band: each lends one per convolution
    assert not use_parallel_vae("auto", wan, latent_rows=3, world=2)
    assert use_parallel_vae("on", wan, latent_rows=2, world=2)
    with pytest.raises(UsageError, match="fewer than the 4 ranks"):
        use_parallel_vae("on", wan, latent_rows=3, world=4)
    qwen = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    assert not use_parallel_vae("auto", qwen, latent_rows=64, world=2)
    with pytest.raises(UsageError, match="AutoencoderKLQwenImage is not split"):
        use_parallel_vae("on", qwen, latent_rows=64, world=2)

"""Patch-parallel decode of the LTX-Video VAE equals the whole decode (the seam test).

Random latents through small AutoencoderKLLTXVideo decoders (the tiny-ltx preset's layout; 0.9.1's
with timestep conditioning and injected noise; 0.9.5's with residual depth-to-space upsamplers),
decoded in bands and whole in one process. Each convolution takes its neighbours' rows and every
rank adds its rows of the whole frame's noise, so only the order of sums differs: fp32 rounding
(~1e-7 per operation) over ~20 layers, well inside 1e-5 of the output's magnitude, while a band
decoded with zero rows at its cut edges, or noise drawn for its own rows, is off by 1e-2 or more.
One rank in process checks the band modules against the stock ones; spawned ranks are slow.
"""


import pytest
import torch
from conftest import RANK_TIMEOUT_S

from cocodiff.run.launch import spawn
from cocodiff.config.sizes import split_sizes

RTOL_OF_SCALE = 1e-5
LATENT = (1, 8, 3, 4, 3)  # (B, C, F, h, w): 3 latent frames -> 9 (two levels up in time); 2 rows a band on 2 ranks
TIMESTEP = torch.tensor([0.05])  # 0.9.1's decode timestep
SEED = 100  # the default generator's, for the injected noise; rank r starts from SEED + r
LAYOUTS = {
    "tiny": dict(decoder_block_out_channels=(8, 16, 16, 16)),  # the tiny-ltx preset's (spatial factor 16)
    # 0.9.1: timestep conditioning and noise after the convolutions of the first two levels (equal widths, as there)
    "0.9.1": dict(decoder_block_out_channels=(16, 16, 16, 16), timestep_conditioning=True,
                  decoder_inject_noise=(True, True, False, False, False)),
    # 0.9.5: residual upsamplers halving the channels, three levels up, patch size 2
    "0.9.5": dict(decoder_block_out_channels=(8, 16, 32, 32), spatio_temporal_scaling=(True, True, True, False),
                  decoder_spatio_temporal_scaling=(True, True, True, False),
                  upsample_residual=(True, True, True, False), upsample_factor=(2, 2, 2, 1), patch_size=2,
                  timestep_conditioning=True),
}


def small_vae(layout: str):
    from diffusers import AutoencoderKLLTXVideo

    config = dict(latent_channels=LATENT[1], block_out_channels=(8, 16, 16, 16), layers_per_block=(1, 1, 1, 1, 1),
                  decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
                  decoder_spatio_temporal_scaling=(True, True, False, False), patch_size=4)
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(**{**config, **LAYOUTS[layout]}).eval()
    with torch.no_grad():  # the default init leaves the noise scales at 0: stir everything
        for p in vae.decoder.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return vae


def latents() -> torch.Tensor:
    return torch.randn(*LATENT, generator=torch.Generator().manual_seed(1))


def timestep(layout: str) -> torch.Tensor | None:
    return TIMESTEP if LAYOUTS[layout].get("timestep_conditioning") else None


def whole_decode(layout: str, seed: int = SEED) -> torch.Tensor:
    vae = small_vae(layout)
    torch.manual_seed(seed)  # after building the VAE, which seeds its weights
    with torch.no_grad():
        return vae.decode(latents(), timestep(layout)).sample


def decode_in_bands() -> dict[str, object]:
    """On each rank: every layout's band decode and the latent rows its decoder was given."""
    import torch.distributed as dist

    from cocodiff.engine.vae.ltx import parallel_decode

    out: dict[str, object] = {}
    for layout in LAYOUTS:
        vae, seen = small_vae(layout), []
        hook = vae.decoder.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[-2]))
        torch.manual_seed(SEED + dist.get_rank())  # rank 0's generator state is the one every rank draws from
        with torch.no_grad():
            out[layout] = parallel_decode(vae, latents(), None, timestep(layout))
        hook.remove()
        out[f"{layout} rows"] = seen
    return out


def test_band_modules_equal_the_stock_ones_on_one_rank(one_rank):
    """In process: the band's convolutions, noise rows and the disabled tiling, with no neighbour."""
    from cocodiff.engine.vae.ltx import parallel_decode

    for layout in LAYOUTS:
        whole = whole_decode(layout)
        vae = small_vae(layout)
        vae.enable_tiling(32, 32, tile_sample_stride_height=16, tile_sample_stride_width=16)  # tiles of 2 latent rows
        torch.manual_seed(SEED)
        with torch.no_grad():
            band = parallel_decode(vae, latents(), None, timestep(layout))
        assert vae.use_tiling  # restored
        assert (band - whole).abs().max() <= RTOL_OF_SCALE * whole.abs().max(), layout
    # the noise is there to be matched: another draw moves the clip by far more than the tolerance
    assert (whole_decode("0.9.1", SEED + 1) - whole_decode("0.9.1")).abs().max() > 1e-2


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def bands(request) -> tuple[int, list[dict[str, object]]]:
    """Every rank's band decodes, once per rank count (4: bands of one latent row, padded whole)."""
    return request.param, spawn(decode_in_bands, request.param, timeout_s=RANK_TIMEOUT_S)


# Spawning ranks takes ~10 s or more on a loaded 2-core machine.
@pytest.mark.slow
def test_band_decode_equals_whole(bands):
    nproc, ranks = bands
    for layout in LAYOUTS:
        clip = whole_decode(layout)
        frames = (LATENT[2] - 1) * small_vae(layout).temporal_compression_ratio + 1  # 9, or 17 three levels up
        assert clip.shape[2:] == (frames, LATENT[-2] * 16, LATENT[-1] * 16)
        assert ranks[0][layout].shape == clip.shape  # rank 0 gathers the clip
        assert (ranks[0][layout] - clip).abs().max() <= RTOL_OF_SCALE * clip.abs().max(), layout
        factor, sizes = clip.shape[-2] // LATENT[-2], split_sizes(LATENT[-2], nproc)
        for rank in range(1, nproc):  # the other ranks keep their bands
            lo = sum(sizes[:rank]) * factor
            band = clip[..., lo:lo + sizes[rank] * factor, :]
            assert (ranks[rank][layout] - band).abs().max() <= RTOL_OF_SCALE * clip.abs().max(), (layout, rank)


@pytest.mark.slow
def test_each_rank_decodes_only_its_rows(bands):
    nproc, ranks = bands
    for layout in LAYOUTS:
        assert [r[f"{layout} rows"] for r in ranks] == [[n] for n in split_sizes(LATENT[-2], nproc)], layout


def test_parallel_vae_choice_for_ltx():
    from cocodiff.errors import UsageError
    from cocodiff.engine.vae import latent_rows, use_parallel_vae

    ltx = small_vae("tiny")
    assert latent_rows(ltx, 64) == 4  # 16 pixels a latent row
    assert use_parallel_vae("auto", ltx, latent_rows=4, world=2)  # two rows per band: each lends one per convolution
    assert not use_parallel_vae("auto", ltx, latent_rows=4, world=4)
    assert use_parallel_vae("on", ltx, latent_rows=4, world=4)
    with pytest.raises(UsageError, match="4 latent rows, fewer than the 8 ranks"):
        use_parallel_vae("on", ltx, latent_rows=4, world=8)


# `verify --parallel-vae on` on 2 ranks: the matrix's parallel vae column (exact, and decoded in bands).

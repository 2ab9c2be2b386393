"""footprint's activation estimate against the real checkpoints' configs, measured without memory.

Each transformer is built from its checkpoint's config under FakeTensorMode (FLUX.1-dev's, SD3.5
Large's and Qwen-Image's widths, heads and text lengths: nothing is allocated), two blocks of each
kind deep: without autograd a block's activations are freed before the next runs, so the peak is
the same at any depth (measured: 931.6, 508.5 and 759.2 MiB at full depth and at two, the full
depth taking 30-75 s a forward on 2 cores, two blocks under a second). One forward at 1024 pixels
square in bf16 is tracked by torch's MemTracker; its peak activations must be within 15%
of `footprint.estimate` for one process (a batch of 2: the estimate counts CFG's two branches).

Per rank under a plan the same forward runs as rank 0 of a fake 8-rank world (collectives move
nothing), under a ring at 1024 pixels square (u4r2) and Ulysses at 2048 (u8): its peak must be
within 15% of `footprint.plan_activations` (the `activations`, `ring_blocks` and `comm_buffers`
of `cocodiff footprint`).
"""

import pytest
import torch
from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel, SD3Transformer2DModel
from test_fake_device import FLUX_DEV
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import torch.distributed as dist

from cocodiff import ParallelConfig, parallelize
from cocodiff.footprint.estimate import DECODE_FACTOR, estimate, plan_activations
from cocodiff.config.plan import parse_plan
from cocodiff.distributed.topology import Topology
from cocodiff.engine.families.sample_inputs import forward_inputs

SD35_LARGE = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                  num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm")
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))


def _two_deep(config: dict) -> dict:
    return {**config, **{key: 2 for key in ("num_layers", "num_single_layers") if key in config}}


CONFIGS = {"flux1-dev": (FluxTransformer2DModel, _two_deep(FLUX_DEV), 512),
           "sd35-large": (SD3Transformer2DModel, _two_deep(SD35_LARGE), 333),
           "qwen-image": (QwenImageTransformer2DModel, _two_deep(QWEN_IMAGE), 512)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_activation_estimate_within_15_percent(name):
    cls, config, text = CONFIGS[name]
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)
        try:
            transformer = cls(**config)
        finally:
            torch.set_default_dtype(torch.float32)
        inputs = forward_inputs(transformer, "cpu", torch.bfloat16, h=64, w=64, text=text, batch=2)
        tracker = MemTracker()
        tracker.track_external(transformer)
        with tracker, torch.no_grad():
            transformer(**inputs, return_dict=False)
        peak = tracker.get_tracker_snapshot("peak")
    measured = sum(n for by_kind in peak.values() for kind, n in by_kind.items() if str(kind).endswith(("ACT", "TEMP")))
    vae = {"block_out_channels": [128]}
    footprint = estimate(dict(transformer.config), vae, height=1024, width=1024, pixel_multiple=16, item_bytes=2,
                         text_tokens=text, family=cls.__name__)
    estimated = footprint.rank_bytes - 1024 * 1024 * 128 * 2 * DECODE_FACTOR  # the transformer's part
    assert abs(estimated / measured - 1) < 0.15, (name, measured / 2**20, estimated / 2**20)


def _peak_activations(cls, config: dict, text: int, pixels: int, plan: str | None = None) -> int:
    """Peak activation bytes of one forward (a batch of 2, bf16) under FakeTensorMode, parallelized
    by `plan` over the default process group where given."""
    groups = None
    if plan is not None:  # groups are made outside the fake mode (they read real tensors)
        topology = Topology.from_env(device=torch.device("cpu"))
        groups = topology.split(parse_plan(plan))
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)
        try:
            transformer = cls(**config)
        finally:
            torch.set_default_dtype(torch.float32)
        if plan is not None:
            parallelize(transformer, ParallelConfig(plan=parse_plan(plan)), topology, groups=groups)
        inputs = forward_inputs(transformer, "cpu", torch.bfloat16, h=pixels // 16, w=pixels // 16, text=text, batch=2)
        tracker = MemTracker()
        tracker.track_external(transformer)
        with tracker, torch.no_grad():
            transformer(**inputs, return_dict=False)
        peak = tracker.get_tracker_snapshot("peak")
    return sum(n for by_kind in peak.values() for kind, n in by_kind.items() if str(kind).endswith(("ACT", "TEMP")))


# Each model under both plans and at both sizes: the ring at 1024 pixels, Ulysses over all 8 ranks at 2048.
@pytest.mark.parametrize("pixels, plan", [(1024, "u4r2"), (2048, "u8")])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_rank_estimate_under_plans_within_15_percent(name, pixels, plan):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cls, config, text = CONFIGS[name]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        measured = _peak_activations(cls, config, text, pixels, plan)
    finally:
        dist.destroy_process_group()
    whole = {"_class_name": cls.__name__, **config}
    footprint = estimate(whole, {"block_out_channels": [128]}, height=pixels, width=pixels, pixel_multiple=16, item_bytes=2,
                         text_tokens=text, family=cls.__name__, call_batch=2)
    p = parse_plan(plan)
    parts = plan_activations(footprint, whole, family=cls.__name__, call_batch=2, item_bytes=2, text_tokens=text,
                             ulysses=p.ulysses, ring=p.ring)
    estimated = sum(parts.values())
    assert abs(estimated / measured - 1) < 0.15, (name, pixels, plan, measured / 2**20, estimated / 2**20, parts)


def test_sharded_weights_peak_at_the_shards_and_two_blocks(monkeypatch):
    """FSDP2 as `--shard-weights on` sets it up (FLUX.1-dev's widths at 2 double + 2 single blocks,
    rank 0 of a fake 8-rank world, u8, 1024 pixels, bf16) tracked by torch's FSDPMemTracker: at
    its peak a rank holds its shards, the running block and the block arriving, no more (FSDP2's
    default keeps a third, the last all-gather buffer), and footprint's figure is within 15%."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cocodiff.engine.shard

    config = {**FLUX_DEV, "num_layers": 2, "num_single_layers": 2}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        topology = Topology.from_env(ranks_per_node=8, device=torch.device("cpu"))
        plan = parse_plan("u8")
        groups = topology.split(plan)
        mesh = init_device_mesh("cpu", (1, 8), mesh_dim_names=("node", "shard"))  # made outside the fake mode
        monkeypatch.setattr(cocodiff.engine.shard, "sharing_mesh", lambda *args, **kwargs: mesh["shard"])
        with FakeTensorMode():
            torch.set_default_dtype(torch.bfloat16)
            try:
                transformer = FluxTransformer2DModel(**config)
            finally:
                torch.set_default_dtype(torch.float32)
            whole = sum(p.numel() * p.element_size() for p in transformer.parameters())
            block = max(sum(p.numel() * p.element_size() for p in b.parameters())
                        for b in (*transformer.transformer_blocks, *transformer.single_transformer_blocks))
            inputs = forward_inputs(transformer, "cpu", torch.bfloat16, h=64, w=64, text=512, batch=1)
            parallelize(transformer, ParallelConfig(plan=plan, shard_weights=True), topology, groups=groups)
            tracker = FSDPMemTracker(transformer)
            with tracker, torch.no_grad():
                transformer(**inputs, return_dict=False)
            peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    finally:
        dist.destroy_process_group()
    footprint = estimate({"_class_name": "FluxTransformer2DModel", **config}, {"block_out_channels": [128]}, height=1024,
                         width=1024, pixel_multiple=16, item_bytes=2, text_tokens=512, call_batch=1)
    parts = plan_activations(footprint, {"_class_name": "FluxTransformer2DModel", **config}, family=None, call_batch=1,
                             item_bytes=2, text_tokens=512, ulysses=8)
    activations = sum(parts.values())  # within 15% of the measured ones (the tests above)
    assert peak["Total"] <= whole / 8 + 2 * block + 1.15 * activations, (peak["Total"] / 2**20, whole / 8 / 2**20, block / 2**20)
    estimated = whole / 8 + 2 * block + activations
    assert abs(estimated / peak["Total"] - 1) < 0.15, (peak["Total"] / 2**20, estimated / 2**20)

"""Masks and projections on the dispatcher's sequence-parallel path (engine/attention/dispatch.py).

An LTX-Video transformer (stock processors, its own `_cp_plan`: the text and its additive per-head
mask split; every block's cross-attention rebuilds the mask from the one the transformer hands
it) on 2 gloo ranks, against one process:

* the mask is all-gathered once per forward pass, not once per block, and a later forward pass
  (the same values in a new tensor, or other values) gathers its own;
* V-First's early projection calls the projection, so its hooks run: a torch pre-hook (counted,
  and before Q's projection), and diffusers' layerwise casting (fp8 weights, cast at each call);

and in one process, on rank 0 of a fake 2-rank world: a bool mask reaches cuDNN's kernel as the
equivalent additive bias, a 2-D mask whose first dim is not the batch is refused in one line, and
a fused QKV+MLP projection with hooks is not a V-First candidate (its V rows would skip them).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import RANK_TIMEOUT_S

from cocodiff import ParallelConfig
from cocodiff.run.launch import spawn

# fp32. Sharded matmuls and attention over keys in another order round differently from one
# process (~1e-7 relative per operation); a wrong token, head or mask differs by ~1e-1.
RTOL_OF_SCALE = 1e-4
LAYERS, FRAMES, H, W, TEXT = 3, 2, 3, 5, 7  # 30 image and 7 text tokens: uneven shares on 2 ranks
PASSES = 3  # the masks of `_masks()`
SCENARIOS = ("plain", "pre_hooks", "fp8_storage")


def _model(scenario: str) -> torch.nn.Module:
    from diffusers import LTXVideoTransformer3DModel
    from diffusers.hooks import apply_layerwise_casting

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8,
                                       cross_attention_dim=32, num_layers=LAYERS, caption_channels=16).eval()
    if scenario == "fp8_storage":  # each Linear's forward wrapped: weights kept in fp8, cast to fp32 per call
        apply_layerwise_casting(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    return model


def _masks() -> list[torch.Tensor]:
    """Text masks of the forward passes: one, another, the first again."""
    first = torch.ones(2, TEXT)
    first[0, 5:] = 0
    first[1, 2] = 0  # padding, not only at the end
    other = torch.ones(2, TEXT)
    other[0, 1] = 0
    other[1, 3:] = 0
    return [first, other, first]


def _forwards(model: torch.nn.Module) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(2, FRAMES * H * W, 8, generator=g), torch.randn(2, TEXT, 16, generator=g)
    with torch.no_grad():
        return [model(hidden_states=x, encoder_hidden_states=text, timestep=torch.tensor([700, 300]),
                      encoder_attention_mask=mask, num_frames=FRAMES, height=H, width=W, return_dict=False)[0]
                for mask in _masks()]


def _projection_order(model: torch.nn.Module) -> list[list[str]]:
    """Per attention call, the order its Q and V projections start in (forward pre-hooks: 'q', 'v')."""
    calls: list[list[str]] = []
    for block in model.transformer_blocks:
        for attn in (block.attn1, block.attn2):
            # Ahead of the engine's own pre-hook on the module, which projects V early.
            attn.register_forward_pre_hook(lambda _m, _a: calls.append([]), prepend=True)
            attn.to_q.register_forward_pre_hook(lambda _m, _a: calls[-1].append("q"))
            attn.to_v.register_forward_pre_hook(lambda _m, _a: calls[-1].append("v"))
    return calls


def run_scenarios(parallel: bool) -> dict[str, dict]:
    """Each scenario's forward passes, the order of its projections; on ranks, also the mask gathers
    of each pass and whether a gathered mask is still held after the last."""
    from cocodiff import parallelize

    results = {}
    for scenario in SCENARIOS:
        model = _model(scenario)
        calls = _projection_order(model) if scenario == "pre_hooks" else []
        gathers: list[int] = []  # per forward pass
        dispatched = parallelize(model, ParallelConfig(comm="flat")).dispatched if parallel else None
        if dispatched is not None:
            gather = dispatched._gather

            def counted(x: torch.Tensor, seq: list[int], gather=gather, gathers=gathers) -> torch.Tensor:
                if x.dtype != torch.int64:  # not the token counts of a module's first call: a mask
                    gathers[-1] += 1
                return gather(x, seq)

            dispatched._gather = counted
            model.register_forward_pre_hook(lambda _m, _a, gathers=gathers: gathers.append(0))  # a pass starts
        outs = _forwards(model)
        held = dispatched is not None and dispatched._gathered_mask is not None
        results[scenario] = {"outs": outs, "gathers": gathers, "held": held, "calls": calls}
    return results


@pytest.fixture(scope="module")
def runs() -> tuple[dict, list[dict]]:
    return run_scenarios(False), spawn(run_scenarios, 2, True, timeout_s=RANK_TIMEOUT_S)


def _assert_equal(reference: list[torch.Tensor], outs: list[torch.Tensor], what: str) -> None:
    for i, (ref, out) in enumerate(zip(reference, outs)):
        diff = (out - ref).abs().max().item()
        assert diff <= RTOL_OF_SCALE * ref.abs().max().item(), f"{what}, forward pass {i}: max diff {diff:.3g}"


def test_the_key_mask_is_gathered_once_per_forward_pass(runs):
    reference, ranks = runs
    for rank, result in enumerate(ranks):
        run = result["plain"]
        # One mask per pass (every block's cross-attention builds its own from it): one gather each;
        # the second pass's other mask and the third's first again each gather their own.
        assert run["gathers"] == [1, 1, 1], f"rank {rank}: mask gathers per pass {run['gathers']}, {LAYERS} blocks"
        assert not run["held"], f"rank {rank}: a gathered mask outlives its forward pass"
        _assert_equal(reference["plain"]["outs"], run["outs"], f"rank {rank}")


def test_the_early_v_projection_runs_the_projections_hooks(runs):
    reference, ranks = runs
    for rank, result in enumerate(ranks):
        run = result["pre_hooks"]
        calls = run["calls"]
        assert len(calls) == 2 * LAYERS * PASSES
        # After each module's first call (which finds how V is built), V is projected before the
        # processor starts (Q first), through the projection's pre-hook: every call of passes 2 and 3.
        early = [c for c in calls[2 * LAYERS:] if c[:1] == ["v"] and "q" in c]
        assert len(early) == 2 * LAYERS * (PASSES - 1), f"rank {rank}: projections per call {calls}"
        _assert_equal(reference["pre_hooks"]["outs"], run["outs"], f"rank {rank}, pre-hooks")
        _assert_equal(reference["fp8_storage"]["outs"], result["fp8_storage"]["outs"], f"rank {rank}, fp8 storage")


# -- one process, rank 0 of a fake 2-rank world ------------------------------------------------
@pytest.fixture
def dispatched():
    """The LTX transformer's dispatcher state on rank 0 of a fake world of 2 (collectives move nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cocodiff import parallelize

    dist.init_process_group("cpu:fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield parallelize(_model("plain"), ParallelConfig(comm="flat")).dispatched
    finally:
        dist.destroy_process_group()


def _cudnn_on_the_cpu(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                      return_debug_mask=False, *, scale=None):
    """aten's cuDNN attention as the CPU can run it: (B, H, S, D) in, the output first of nine, and
    like the kernel, an additive bias in the query's dtype only."""
    if attn_bias is not None and attn_bias.dtype != query.dtype:
        raise RuntimeError(f"cuDNN attention takes an attn_bias of the query's dtype, not {attn_bias.dtype}")
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_bias, is_causal=is_causal, scale=scale)
    return (out,) + (None,) * 8


def test_a_bool_mask_reaches_cudnn_as_the_equivalent_bias(dispatched, monkeypatch):
    from diffusers.models import attention_dispatch

    from cocodiff.engine.attention import dispatch

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", _cudnn_on_the_cpu)
    cudnn, native = attention_dispatch._cudnn_attention_forward_op, attention_dispatch._native_attention_forward_op
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 8, generator=g) for _ in range(3))  # (B, H_r, S, D)
    keep = torch.rand(2, 1, 1, 9, generator=g) > 0.3
    keep[..., 0] = True  # every query has a key
    bias = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    expected = dispatched._local(q, k, v, keep, None, native, [5, 4])  # SDPA takes the bool mask itself
    for mask in (keep, bias):  # after the split: this rank's heads over every key
        torch.testing.assert_close(dispatched._local(q, k, v, mask, None, cudnn, [5, 4]), expected)
    assert not dispatched.ctx.split  # before the split: the whole sequence, as in one process
    t = (lambda x: x.transpose(1, 2))  # the dispatcher's (B, S, H, D)
    whole = dispatch._routed(t(q), t(k), t(v), keep, forward_op=cudnn, _parallel_config=dispatched.marker)
    torch.testing.assert_close(t(whole), expected)


def test_a_2d_mask_whose_first_dim_is_not_the_batch_is_refused_in_one_line(dispatched):
    dispatched.layer = "transformer_blocks.0.attn2"
    with pytest.raises(ValueError) as error:
        dispatched._mask(torch.ones(3, 4, dtype=torch.bool), [4, 3], batch=2)  # (S_q, S_kv), not (B, S_kv)
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("transformer_blocks.0.attn2: a (3, 4) attention mask for a batch of 2")


def test_a_hooked_fused_projection_is_no_v_first_candidate():
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2ParallelSelfAttention,
    )

    from cocodiff.engine.attention.dispatch import _candidates

    attn = Flux2ParallelSelfAttention(16, heads=2, dim_head=8)
    states = torch.randn(1, 5, 16)
    assert set(_candidates(attn, states, None)) == {"fused"}
    attn.to_qkv_mlp_proj.register_forward_pre_hook(lambda _m, _a: None)  # e.g. weights brought in per call
    assert _candidates(attn, states, None) == {}


def test_a_square_mask_is_taken_as_a_key_mask_only_when_it_is_one_token_masks_outer_product():
    """HunyuanVideo 1.5's S x S mask is m_i & m_j of its token mask m, and Chroma's float one m_i * m_j of
    a 0/1 mask; a mask of any other form (causal, a float one of other values, not square) is not, and
    the check reads nothing on the host (a tensor on the mask's device, `meta` too, for the all-reduce
    every rank takes)."""
    from cocodiff.engine.attention.dispatch import _outer

    m = torch.tensor([[True, True, False], [True, False, True]])
    outer = m[:, None, :, None] & m[:, None, None, :]
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None].expand(2, 1, 3, 3)
    assert _outer(outer).item() is True and _outer(outer.float()).item() is True
    halves = outer.float() * 0.5  # diagonal 0.5, where m_i * m_j of it is 0.25
    assert [_outer(x).item() for x in (causal, causal.float(), halves, outer[..., :2])] == [False] * 4
    assert _outer(outer.to("meta")).device.type == "meta"

"""Ring attention across Ulysses groups: K/V blocks travel around the ring, outputs merge by LSE.

After Ulysses' all-to-all a rank holds (B, H_r, S_g, D) q, k and v: its Ulysses group's chunk
of the sequence for its share of the heads. The ring joins the ranks that hold the same heads
for the R chunks; ring rank g starts with its own block and, at ring step j, attends its queries
to the block of chunk (g - j) mod R while the next block is already in flight (async p2p, two
buffers). Each block's partial output comes with its log-sum-exp, and the partial outputs fold
into one, in fp32:

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

which is softmax attention over the union of the blocks' keys: no block is padded (blocks may
differ in length) and a masked key never gets weight. A block whose keys are all masked for a
batch item has lse = -inf there and weight 0. The order of the folds is fixed by the plan, so a
run is bit-for-bit repeatable.

With a wire format (LOSSY, `PeerGroup.wire`) on the level a hop crosses, the hop's K|V block
travels packed, one scale per (token, head) of K and of V, K at `Wire.k_format` at least; a block
forwarded on a hop of the same formats goes on as the bytes it arrived in (rounded once, not
again). Hops over other levels carry the block as the rank holds it, bit for bit.

    attend_block:  q (B, H, Sq, D), k/v (B, H, Sk, D), key_mask (B, Sk) -> out (B, H, Sq, D), lse (B, H, Sq)
                   (key_mask: bool, True = attend; or a float bias added to the scores, as LTX's -10000)
    merge:         two partial results -> their union's
"""

from __future__ import annotations

import math

import torch

from cocodiff.distributed.comm.group import PeerGroup
from cocodiff.distributed.comm.wire import Formats, pack, packed_bytes, unpack

__all__ = ["Ring", "attend_block", "block_kernel", "merge"]

_KV = ("k", "")
"""The roles of a ring block's rows, for the wire formats: K (kept at `Wire.k_format` at least), then V."""


def attend_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one block of keys: (fp32 output, fp32 log-sum-exp of the scores).

    A fused kernel that returns the log-sum-exp with the output (`block_kernel`), so no
    (Sq, Sk) score matrix is ever held: flash (or, with a mask or in fp32, memory-efficient)
    attention on CUDA, torch's flash kernel on the CPU in any float dtype, query chunks of
    bounded size elsewhere. Rows with no valid key get lse = -inf and a zero output.
    """
    B, H, Sq, _ = q.shape
    if k.shape[2] == 0:  # an empty block: no key, no weight
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_full((B, H, Sq), float("-inf"), dtype=torch.float32)
    kernel = block_kernel(q, key_mask is not None)
    if kernel == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
        lse = lse.reshape(B, H, Sq)  # (B, H, Sq, 1) in some builds
    elif kernel == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
    elif kernel == "efficient":
        bias = _additive_mask(key_mask, q, align=16) if key_mask is not None else None
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)[:2]
        lse = lse[..., :Sq]  # its rows are padded to a multiple of 32
    elif kernel == "cpu-flash":
        bias = _additive_mask(key_mask, q) if key_mask is not None else None
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias)
    else:
        out, lse = _chunked(q, k, v, key_mask)
    if key_mask is not None and key_mask.dtype == torch.bool:
        empty = ~key_mask.any(dim=-1)  # (B,): no valid key in this block for that item
        lse = lse.masked_fill(empty[:, None, None], float("-inf"))
        out = out.masked_fill(empty[:, None, None, None], 0.0)
    return out.float(), lse.float()


def block_kernel(q: torch.Tensor, masked: bool) -> str:
    """Which fused kernel `attend_block` runs for these queries: cudnn, flash, efficient,
    cpu-flash or chunked. `meta` tensors (the CPU stand-in for a GPU in tests) take CUDA's choice
    on an Ampere-class GPU. On Hopper cuDNN's attention (also SDPA's default there) is taken where
    it applies: 2x flash's speed at FLUX's shapes on an H200 (docs/results/gpu-nvidia-h200.json)."""
    if q.device.type == "cpu":
        return "cpu-flash"
    if q.device.type not in ("cuda", "meta"):
        return "chunked"
    half = q.dtype in (torch.float16, torch.bfloat16)
    head_ok = q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
    major = 8 if q.device.type == "meta" else torch.cuda.get_device_capability(q.device)[0]
    if half and head_ok and major >= 9 and not masked and torch.backends.cuda.cudnn_sdp_enabled():
        return "cudnn"
    if half and head_ok and major >= 8 and not masked and torch.backends.cuda.flash_sdp_enabled():
        return "flash"
    return "efficient" if q.shape[-1] % 8 == 0 else "chunked"


def _additive_mask(key_mask: torch.Tensor, q: torch.Tensor, align: int = 1) -> torch.Tensor:
    """(B, Sk) bool key mask -> (B, H, Sq, Sk) additive bias (0 or -inf) in q's dtype, a broadcast
    view of one (B, 1, 1, Sk) row; its last dim padded to `align` in memory, as the
    memory-efficient kernel wants."""
    B, Sk = key_mask.shape
    padded = -(-Sk // align) * align
    bias = q.new_zeros(B, 1, 1, padded)
    if key_mask.is_floating_point():  # an additive bias: a key it lowers keeps some weight, as in one process
        bias[..., :Sk] = key_mask[:, None, None, :]
    else:
        bias[..., :Sk].masked_fill_(~key_mask[:, None, None, :], float("-inf"))
    return bias[..., :Sk].expand(B, q.shape[1], q.shape[2], Sk)


CHUNK_SCORES = 1 << 24
"""Scores (fp32) one query chunk of the fallback holds at once: 64 MiB."""


def _chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention with log-sum-exp in plain torch, a chunk of queries at a time (devices
    with no fused kernel that returns it): memory O(chunk x Sk), never O(Sq x Sk)."""
    B, H, Sq, D = q.shape
    rows = max(1, CHUNK_SCORES // max(1, B * H * k.shape[2]))
    outs, lses = [], []
    for start in range(0, Sq, rows):
        scores = (q[:, :, start : start + rows].float() @ k.float().transpose(-1, -2)) * D**-0.5  # (B, H, rows, Sk)
        if key_mask is not None and key_mask.is_floating_point():
            scores = scores + key_mask[:, None, None, :].float()
        elif key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
        outs.append(weights.nan_to_num(0.0) @ v.float())
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold two partial attentions of the same queries over disjoint keys into one (fp32)."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)  # -inf only where neither part has a valid key
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    weight_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse)).unsqueeze(-1)
    weight_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse)).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


class Ring(PeerGroup):
    """This rank's ring: the ranks that hold the same heads of the R sequence chunks.

    `members[g]` is the global rank holding chunk g; `index` is this rank's g.
    """

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block_sizes: list[int],
        block_masks: list[torch.Tensor | None],
    ) -> torch.Tensor:
        """(B, H_r, S_q, D) q and this chunk's k, v -> attention over every chunk's keys, q's dtype.

        block_sizes[g]: key tokens of chunk g (known to every rank from the layout);
        block_masks[g]: (B, block_sizes[g]) key mask (or additive bias) of chunk g, or None for all valid.
        """
        R, g = self.size, self.index
        B, H, _, D = k.shape
        block = torch.cat([k, v], dim=-1).contiguous()  # (B, H_r, S_g, 2D): one message per hop
        carried: tuple[torch.Tensor, Formats] | None = None  # the block's bytes as it last arrived packed
        out = lse = None
        nxt, prv = self.members[(g + 1) % R], self.members[(g - 1) % R]
        to_next, from_prev = self.formats_to(nxt, _KV), self.formats_to(prv, _KV)
        for step in range(R):
            source = (g - step) % R
            pending = None
            if step < R - 1:
                shape = (B, H, block_sizes[(source - 1) % R], 2 * D)
                message = self._message(block, carried, to_next, D)
                incoming = block.new_empty(shape) if from_prev is None else block.new_empty(
                    packed_bytes(math.prod(shape), from_prev, D, block.element_size()), dtype=torch.uint8)
                works = self._p2p(receives=[(incoming, prv)], sends=[(message, nxt)])
                self._count("ring", nxt, message)
                pending = (works, incoming, shape, self.stats.mark() if self.stats is not None else None)
            key, value = block.split(D, dim=-1)
            part_out, part_lse = attend_block(q, key, value, block_masks[source])
            out, lse = (part_out, part_lse) if out is None else merge(out, lse, part_out, part_lse)
            if pending is not None:
                works, incoming, shape, posted = pending
                start = self.stats.mark() if self.stats is not None else None
                self._wait(works, "ring")
                if self.stats is not None:  # in flight from post to arrival; exposed: the wait
                    end = self.stats.mark()
                    self.stats.in_flight("ring", posted, end)
                    self.stats.waited("ring", start, end)
                if from_prev is None:
                    block, carried = incoming, None
                else:  # (B, H_r, S, K|V) as the wire delivers it; its bytes go on as they are where the next hop packs alike
                    block = unpack(incoming, from_prev, math.prod(shape), D, block.dtype).view(shape)
                    carried = (incoming, from_prev)
        return out.to(q.dtype)

    @staticmethod
    def _message(block: torch.Tensor, carried: tuple[torch.Tensor, Formats] | None, formats: Formats | None, D: int) -> torch.Tensor:
        """What goes to the next ring rank: the block itself over an exact link; else its bytes in
        the link's formats - those it arrived in when they match (forwarded, not rounded again)."""
        if formats is None:
            return block
        if carried is not None and carried[1] == formats:
            return carried[0]
        return pack(block, formats, D)

"""Ring attention's block kernels: fused, with the log-sum-exp, never an S x S score matrix.

On CPU torch's flash kernel (fp32 and bf16); on `meta` (CUDA's choice: flash without a mask in
bf16, memory-efficient with one); the chunked fallback of other devices. Each is exact against
one-shot attention, and the CPU kernel's extra memory at 16k x 16k tokens stays far below the
1 GiB an fp32 score matrix would take.
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import patience

from cocodiff.engine.attention import ring
from cocodiff.engine.attention.ring import attend_block, block_kernel, merge


def _blocks_vs_one_shot(dtype, kernel=None, monkeypatch=None, masked=True):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 17, 16, generator=g).to(dtype)
    k = torch.randn(2, 3, 29, 16, generator=g).to(dtype)
    v = torch.randn(2, 3, 29, 16, generator=g).to(dtype)
    mask = torch.rand(2, 29, generator=g) > 0.4 if masked else None
    if masked:
        mask[1, :10] = False  # item 1: the first block has no valid key at all
        mask[:, 20] = True
    if kernel is not None:
        monkeypatch.setattr(ring, "block_kernel", lambda *_: kernel)
    out = lse = None
    for sl in (slice(0, 10), slice(10, 29)):
        part = attend_block(q, k[:, :, sl], v[:, :, sl], mask[:, sl] if masked else None)
        out, lse = part if out is None else merge(out, lse, *part)
    expected = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask[:, None, None, :] if masked else None
    )
    return out, expected


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_flash_blocks_equal_one_shot(dtype, masked):
    out, expected = _blocks_vs_one_shot(dtype, masked=masked)
    # bf16: inputs and each block's output round at ~4e-3; fp32: ~1e-7 per fold.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_chunked_fallback_equals_one_shot(monkeypatch):
    monkeypatch.setattr(ring, "CHUNK_SCORES", 2 * 3 * 29 * 4)  # 4 query rows per chunk: several chunks
    out, expected = _blocks_vs_one_shot(torch.float32, "chunked", monkeypatch)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dtype, masked, kernel",
    [(torch.bfloat16, False, "flash"), (torch.bfloat16, True, "efficient"), (torch.float32, False, "efficient")],
)
def test_meta_takes_cuda_kernels_with_lse_of_the_queries(dtype, masked, kernel):
    """On a device the fused CUDA kernels run (meta stands in: shapes only): the efficient
    kernel's log-sum-exp, padded to 32 rows, comes back sliced to the queries."""
    q = torch.empty(1, 2, 45, 64, device="meta", dtype=dtype)
    k = v = torch.empty(1, 2, 70, 64, device="meta", dtype=dtype)
    mask = torch.ones(1, 70, dtype=torch.bool, device="meta") if masked else None
    assert block_kernel(q, masked) == kernel
    out, lse = attend_block(q, k, v, mask)
    assert out.shape == (1, 2, 45, 64) and lse.shape == (1, 2, 45)
    assert out.dtype == lse.dtype == torch.float32


MEMORY_PROBE = """
import resource, sys, torch
from cocodiff.engine.attention.ring import attend_block
torch.set_num_threads(2)
dtype = getattr(torch, sys.argv[1])
S, D = 16384, 64
q, k, v = (torch.randn(1, 1, S, D).to(dtype) for _ in range(3))
mask = torch.ones(1, S, dtype=torch.bool)
mask[:, -100:] = False
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out, lse = attend_block(q, k, v, mask)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_memory_is_linear_at_16k_tokens(dtype):
    """One head, 16 384 x 16 384 tokens, a key mask: an fp32 score matrix would be 1 GiB."""
    run = subprocess.run([sys.executable, "-c", MEMORY_PROBE, dtype], capture_output=True, text=True, timeout=patience(240))
    assert run.returncode == 0, run.stderr
    extra = int(run.stdout.split()[-1])
    assert extra < 256 * 2**20, f"{extra / 2**20:.0f} MiB of extra memory for one block"

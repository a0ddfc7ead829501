"""What kernel and model tests share: the devices (CUDA marked, and skipped without a GPU), the
dtypes, per-dtype tolerances, output poisoning, strided copies and paged K/V caches."""

from __future__ import annotations

import math

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Kernels and references round to the storage dtype at the same places, so what
# is left is float32 accumulation order: ~1e-6 relative in float32. Half types
# can then land one rounding step apart: bfloat16 has 8 mantissa bits (one ulp
# = 2^-7 ≈ 7.8e-3 relative), float16 has 11 (2^-10 ≈ 9.8e-4); we allow two ulps.
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with NaN so that any element a kernel fails to write fails the test."""
    return t.fill_(float("nan"))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, **kw) -> None:
    tol = dict(TOLERANCES[dtype or expected.dtype]) if (dtype or expected.dtype) in TOLERANCES else {}
    tol.update(kw)
    torch.testing.assert_close(actual, expected, equal_nan=False, **tol)


def strided(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """A copy of ``t`` whose rows (dim 0) are strided: padding after every row, last dim contiguous."""
    rows = t.shape[0]
    inner = t[0].numel() if rows else 0
    buf = torch.full((rows, inner + pad), float("nan") if t.is_floating_point() else -7, dtype=t.dtype, device=t.device)
    view = buf[:, :inner].view(rows, *t.shape[1:])
    view.copy_(t)
    return view


def paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, table_dtype=torch.int32,
             spare_columns=1):
    """Per-sequence K/V ``[L_b, Hk, D]`` scattered into randomly permuted cache blocks.

    Returns ``k_cache, v_cache [num_blocks, block_size, Hk, D], block_tables
    [B, max_blocks], seqs`` with ``seqs[b] = (k_b, v_b)`` unpaged. Blocks (and
    block tails) no sequence uses hold noise of another scale; table entries
    beyond a sequence's blocks point at random valid blocks or are -1.
    """
    shape = (num_kv_heads, head_dim)
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(blocks_needed + [0]) + spare_columns
    num_blocks = sum(blocks_needed) + 3
    k_cache = (5 * torch.randn(num_blocks, block_size, *shape)).to(dtype)
    v_cache = (5 * torch.randn(num_blocks, block_size, *shape)).to(dtype)
    perm = torch.randperm(num_blocks)
    tables = torch.where(torch.rand(len(seq_lens), max_blocks) < 0.5,
                         torch.randint(0, num_blocks, (len(seq_lens), max_blocks)), -1)
    seqs, first = [], 0
    for b, n in enumerate(seq_lens):
        k, v = torch.randn(n, *shape).to(dtype), torch.randn(n, *shape).to(dtype)
        ids = perm[first : first + blocks_needed[b]]
        first += blocks_needed[b]
        tables[b, : len(ids)] = ids
        t = torch.arange(n)
        k_cache[ids[t // block_size], t % block_size] = k
        v_cache[ids[t // block_size], t % block_size] = v
        seqs.append((k.to(device), v.to(device)))
    return k_cache.to(device), v_cache.to(device), tables.to(device, table_dtype), seqs

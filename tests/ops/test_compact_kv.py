"""A compact KV cache (int8 or float8_e4m3fn codes, a float16 scale per token and KV head):
reshape_and_cache's quantising write and decode_attention's reads of codes.

The write is held bit for bit to stagewise.ops.reference.quantise_kv (each row by itself, so
every device and ISA level stores the same bytes); attention is held to the reference over the
dequantised cache, and to a float64 softmax attention over the dequantised K/V built here, and
its error against the unquantised K/V is bounded by what the codes lose.
"""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import DEVICES, DTYPES, TOLERANCES, assert_close, poison_

import stagewise.ops as ops
from stagewise.ops import reference

CODES = [torch.int8, torch.float8_e4m3fn]
CODE_IDS = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}


def _cache(num_blocks, block_size, heads, head_dim, codes, device):
    shape = (num_blocks, block_size, heads)
    k = torch.zeros(*shape, head_dim, dtype=codes, device=device)
    return k, k.clone(), torch.full(shape, float("nan"), dtype=torch.float16, device=device), \
        torch.full(shape, float("nan"), dtype=torch.float16, device=device)


@pytest.mark.parametrize("codes", CODES, ids=CODE_IDS.get)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,head_dim", [(3, 83), (2, 64), (8, 128)])
def test_write_is_the_reference_bit_for_bit(device, heads, head_dim, dtype, codes):
    tokens = 37
    k = (torch.randn(tokens, heads, head_dim) * torch.logspace(-3, 3, tokens)[:, None, None]).to(dtype)
    v = torch.randn(tokens, heads, head_dim).to(dtype)
    k[4, 0] = 0  # an all-zero row: scale 0, codes 0
    k[5, 1, 7] = 1e6  # beyond float16's range over 127: the scale is capped, the code clamped
    v[6, :, 3] = -v[6].abs().amax()  # the extreme code on the negative side
    k, v = k.to(device), v.to(device)
    cache = _cache(8, 16, heads, head_dim, codes, device)
    slots = torch.randperm(8 * 16)[:tokens].to(device)
    slots[9] = -1  # padding: nothing written
    expected = reference.reshape_and_cache(k, v, *cache[:2], slots, *cache[2:])
    ops.reshape_and_cache(k, v, *cache[:2], slots, *cache[2:])
    for got, want in zip(cache, expected):
        assert got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got.nan_to_num(7.0),
                           want.view(torch.uint8) if want.element_size() == 1 else want.nan_to_num(7.0))
    # Each stored row read back is within half a code step of what was written.
    rows = slots[slots >= 0].long()
    for x, c, s in ((k, cache[0], cache[2]), (v, cache[1], cache[3])):
        back = reference.dequantise_kv(c.view(-1, heads, head_dim)[rows], s.view(-1, heads)[rows])
        step = s.view(-1, heads)[rows].float().unsqueeze(-1)
        err = (back - x[slots >= 0].float()).abs()
        bound = 0.5 * step if codes == torch.int8 else 0.07 * x[slots >= 0].float().abs() + 2**-9 * step
        if x is k:
            keep = (x[slots >= 0].float().abs() < 127 * 65504)  # the clamped value of row 5
            err, bound = err[keep], (bound * torch.ones_like(err))[keep]
        assert bool((err <= bound * 1.001 + 1e-30).all())


def _paged(seq_lens, heads, head_dim, block_size, codes, device, dtype):
    """K/V of each sequence quantised into randomly placed blocks; returns the cache, its scales,
    the block tables and each sequence's unquantised K/V."""
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    k_cache, v_cache, k_scale, v_scale = _cache(num_blocks, block_size, heads, head_dim, codes, device)
    perm = torch.randperm(num_blocks)
    tables = torch.full((len(seq_lens), max(blocks) + 1), -1, dtype=torch.int32)
    seqs, first = [], 0
    for b, n in enumerate(seq_lens):
        tables[b, : blocks[b]] = perm[first : first + blocks[b]]
        first += blocks[b]
        k, v = (torch.randn(n, heads, head_dim) * 2).to(dtype).to(device), torch.randn(n, heads, head_dim).to(dtype).to(device)
        t = torch.arange(n)
        slots = (tables[b].long()[t // block_size] * block_size + t % block_size).to(device)
        ops.reshape_and_cache(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        seqs.append((k, v))
    return (k_cache, v_cache, k_scale, v_scale), tables.to(device), seqs


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("with_new", [False, True])
# GQA groups of 4, 1, 3 and 6 query heads: the kernels take a group's heads four at a time
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (9, 3), (12, 2)], ids=lambda h: f"hq{h[0]}-hk{h[1]}")
@pytest.mark.parametrize("codes", CODES, ids=CODE_IDS.get)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 91])
@pytest.mark.parametrize("device", DEVICES)
def test_attention_matches_reference_and_plain_attention(device, head_dim, dtype, codes, heads, with_new,
                                                          num_splits):
    if device != "cpu" and head_dim not in (64, 128, 256):
        pytest.skip("the CUDA kernel takes head_dim 64, 128 or 256")
    hq, hk = heads
    seq_lens = [0, 1, 16, 17, 100, 333]
    cache, tables, seqs = _paged(seq_lens, hk, head_dim, 16, codes, device, dtype)
    B = len(seq_lens)
    q = torch.randn(B, hq, head_dim).to(dtype).to(device)
    new = [torch.randn(B, hk, head_dim).to(dtype).to(device) for _ in range(2)] if with_new else [None, None]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out, lse = ops.decode_attention(q, cache[0], cache[1], tables, lens, head_dim**-0.5, *new, num_splits,
                                    out=poison_(torch.empty_like(q)), k_scale=cache[2], v_scale=cache[3])
    ref_out, ref_lse = reference.decode_attention(q, cache[0], cache[1], tables, lens, head_dim**-0.5, *new,
                                                  k_scale=cache[2], v_scale=cache[3])
    assert_close(out, ref_out, dtype)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-4)
    # Against the unquantised K/V: what the codes lose, a few code steps' worth of attention.
    for b, (k, v) in enumerate(seqs):
        if with_new:
            k, v = torch.cat([k, new[0][b : b + 1]]), torch.cat([v, new[1][b : b + 1]])
        exact, _ = reference.attention_with_lse(q[b], k, v, head_dim**-0.5)
        tol = 0.05 if codes == torch.int8 else 0.5  # e4m3 keeps 3 mantissa bits: up to 1/16 of a value
        assert_close(out[b].float(), exact.float(), rtol=0, atol=tol + TOLERANCES[dtype]["atol"])


@pytest.mark.parametrize("codes", CODES, ids=CODE_IDS.get)
@pytest.mark.parametrize("device", DEVICES)
def test_window_reads_only_its_codes(device, codes):
    cache, tables, _ = _paged([50, 7], 2, 64, 8, codes, device, torch.float32)
    q = torch.randn(2, 4, 64, device=device)
    lens = torch.tensor([50, 7], device=device)
    out, lse = ops.decode_attention(q, cache[0], cache[1], tables, lens, 0.125, window=9, k_scale=cache[2],
                                    v_scale=cache[3])
    ref_out, ref_lse = reference.decode_attention(q, cache[0], cache[1], tables, lens, 0.125, window=9,
                                                  k_scale=cache[2], v_scale=cache[3])
    assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_scales_are_checked():
    k = torch.randn(3, 2, 64)
    kc, vc, ks, vs = _cache(4, 16, 2, 64, torch.int8, "cpu")
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"compact cache \(k_cache int8\) needs both 'k_scale' and 'v_scale'"):
        ops.reshape_and_cache(k, k, kc, vc, slots)
    with pytest.raises(TypeError, match=r"argument 'k_scale' must be float16 \(a compact cache's scales\)"):
        ops.reshape_and_cache(k, k, kc, vc, slots, ks.float(), vs)
    with pytest.raises(ValueError, match=r"argument 'v_scale' dim 1 \(as in k_cache\) must be 16"):
        ops.reshape_and_cache(k, k, kc, vc, slots, ks, vs[:, :8])
    with pytest.raises(ValueError, match="'k_scale' and 'v_scale' belong to a compact cache"):
        ops.reshape_and_cache(k, k, torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64), slots, ks, vs)
    with pytest.raises(TypeError, match=r"'v_cache' must have the dtype of 'k_cache' \(int8\)"):
        ops.reshape_and_cache(k, k, kc, vc.view(torch.uint8), slots, ks, vs)
    q = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="needs both 'k_scale' and 'v_scale'"):
        ops.decode_attention(q, kc, vc, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3]), 0.1, k_scale=ks)
    with pytest.raises(TypeError, match=r"must have the dtype of 'q' \(float32\), or be a compact cache"):
        ops.decode_attention(q, kc.to(torch.int16), vc.to(torch.int16), torch.zeros(1, 1, dtype=torch.int32),
                             torch.tensor([3]), 0.1)

"""merge_attn_states: LSE merge of two partial attention results.

Held against stagewise.ops.reference.merge_attn_states, against the exact
"empty side" rule, and against decode_attention over a whole context.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.kernels import DTYPES, TOLERANCES, assert_close, poison_, strided

import stagewise.ops as ops
from stagewise.ops import reference

# lse is float32 in and out: float32 rounding of max + log(w_a + w_b).
LSE_TOL = TOLERANCES[torch.float32]
# Integer views for bit-exact comparison (torch.equal calls -0.0 == +0.0).
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def partials(n, h, d, dtype, device):
    """Two partial results ``[N, H, D]`` (rows strided) and their lse ``[N, H]``, lse spread over +-20."""
    a = strided(torch.randn(n, h, d).to(dtype).to(device))
    b = strided(torch.randn(n, h, d).to(dtype).to(device))
    lse_a = (20 * torch.rand(n, h) - 10).to(device)
    lse_b = (20 * torch.rand(n, h) - 10).to(device)
    return a, lse_a, b, lse_b


def poisoned_outputs(n, h, d, dtype, device):
    out = strided(poison_(torch.empty(n, h, d, dtype=dtype, device=device)))
    return out, poison_(torch.empty(n, h, device=device))


def assert_bits_equal(actual, expected):
    assert torch.equal(actual.view(BITS[actual.dtype]), expected.view(BITS[expected.dtype]))


@pytest.mark.parametrize("shape", [(1, 1, 1), (5, 3, 7), (17, 8, 128), (4, 2, 769)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(device, dtype, shape):
    a, lse_a, b, lse_b = partials(*shape, dtype, device)
    lse_a[0, 0] = -math.inf  # one empty row on one side, one on the other
    lse_b[-1, -1] = -math.inf
    out, lse = poisoned_outputs(*shape, dtype, device)
    ops.merge_attn_states(a, lse_a, b, lse_b, out=out, lse=lse)
    ref_out, ref_lse = reference.merge_attn_states(a, lse_a, b, lse_b)
    assert_close(out, ref_out)
    assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_lse_inputs(device, dtype):
    """The inputs' LSEs may be views with any strides (a gathered buffer's heads, a transpose)."""
    n, h, d = 5, 3, 16
    a, lse_a, b, lse_b = partials(n, h, d, dtype, device)
    wide = torch.full((n, 2 * h + 1), float("nan"), device=device)
    wide[:, 1 : h + 1] = lse_a
    lse_b_t = lse_b.t().contiguous().t()
    out, lse = ops.merge_attn_states(a, wide[:, 1 : h + 1], b, lse_b_t)
    ref_out, ref_lse = reference.merge_attn_states(a, lse_a, b, lse_b)
    assert_close(out, ref_out)
    assert_close(lse, ref_lse, **LSE_TOL)


def test_no_tokens(device):
    a = torch.empty(0, 4, 64, device=device)
    lse_a = torch.empty(0, 4, device=device)
    out, lse = ops.merge_attn_states(a, lse_a, a, lse_a)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_lse_gives_nan_out_and_lse(device, dtype):
    """A NaN lse (a split whose softmax sum is NaN: a NaN query) is never taken for an empty side:
    against -inf, a finite lse or another NaN, that row's out and lse come out NaN, as the
    reference's (torch.maximum propagates NaN); every other row is merged as usual."""
    a, lse_a, b, lse_b = partials(6, 2, 64, dtype, device)
    lse_a[0, 0], lse_b[0, 0] = math.nan, -math.inf
    lse_a[1, 1], lse_b[2, 0] = math.nan, math.nan
    lse_a[3, 0], lse_b[3, 0] = -math.inf, math.nan
    out, lse = poisoned_outputs(6, 2, 64, dtype, device)
    ops.merge_attn_states(a, lse_a, b, lse_b, out=out, lse=lse)
    ref_out, ref_lse = reference.merge_attn_states(a, lse_a, b, lse_b)
    bad = lse_a.isnan() | lse_b.isnan()
    assert ref_lse[bad].isnan().all() and ref_out[bad].isnan().all()
    assert lse[bad].isnan().all() and out[bad].isnan().all()
    assert_close(out[~bad], ref_out[~bad])
    assert_close(lse[~bad], ref_lse[~bad], **LSE_TOL)


@pytest.mark.parametrize("empty_side", ["a", "b"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_side_returns_other_exactly(device, dtype, empty_side):
    """A side with lse = -inf contributes nothing: the other side comes back bit for bit."""
    a, lse_a, b, lse_b = partials(6, 4, 91, dtype, device)
    a[0, 0, :5] = -0.0  # arithmetic such as 1 * a + 0 * b would turn these into +0.0
    b[0, 0, :5] = -0.0
    kept, kept_lse = (b, lse_b) if empty_side == "a" else (a, lse_a)
    (lse_a if empty_side == "a" else lse_b).fill_(-math.inf)  # that side's rows are garbage
    out, lse = poisoned_outputs(6, 4, 91, dtype, device)
    ops.merge_attn_states(a, lse_a, b, lse_b, out=out, lse=lse)
    assert_bits_equal(out, kept)
    assert_bits_equal(lse, kept_lse)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_empty_side_keeps_every_value(device, dtype):
    """Every non-NaN bit pattern of the dtype (subnormals, infinities, -0.0) comes back unchanged."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[~values.isnan()]
    values = values[: values.numel() // 64 * 64].view(-1, 4, 16).to(device)
    other = torch.randn(values.shape).to(dtype).to(device)
    lse_kept = torch.zeros(values.shape[:2], device=device)
    lse_empty = torch.full(values.shape[:2], -math.inf, device=device)
    out, _ = ops.merge_attn_states(other, lse_empty, values, lse_kept)
    assert_bits_equal(out, values)


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_empty(device, dtype):
    a, lse_a, b, lse_b = partials(3, 2, 64, dtype, device)
    lse_a.fill_(-math.inf)
    lse_b.fill_(-math.inf)
    out, lse = poisoned_outputs(3, 2, 64, dtype, device)
    ops.merge_attn_states(a, lse_a, b, lse_b, out=out, lse=lse)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, -math.inf))


@pytest.mark.parametrize("with_new", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_merged_context_halves_equal_whole(device, dtype, with_new):
    """decode_attention over blocks [0, cut) merged with blocks [cut, end) (+ new token) = over the whole."""
    block_size, hq, hk, d = 16, 8, 2, 128
    blocks = torch.tensor([1, 4, 9, 20])  # per sequence
    num_blocks = 4 * 20 + 2
    k_cache = torch.randn(num_blocks, block_size, hk, d).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, block_size, hk, d).to(dtype).to(device)
    tables = torch.randperm(num_blocks)[: 4 * 20].view(4, 20).to(device)  # full rows, random blocks
    seq_lens = (blocks * block_size - torch.tensor([0, 3, 15, 7])).to(device)
    cut = (blocks // 2).to(device)  # the first part is whole blocks; it may be empty
    q = torch.randn(4, hq, d).to(dtype).to(device)
    k_new = v_new = None
    if with_new:
        k_new = torch.randn(4, hk, d).to(dtype).to(device)
        v_new = torch.randn(4, hk, d).to(dtype).to(device)
    scale = d**-0.5

    whole, whole_lse = ops.decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, k_new, v_new)
    head, head_lse = ops.decode_attention(q, k_cache, v_cache, tables, cut * block_size, scale)
    rows = torch.arange(20, device=device)
    tail_tables = torch.where(rows + cut[:, None] < 20, tables.gather(1, (rows + cut[:, None]).clamp(max=19)), -1)
    tail, tail_lse = ops.decode_attention(q, k_cache, v_cache, tail_tables, seq_lens - cut * block_size, scale,
                                          k_new, v_new)
    out, lse = ops.merge_attn_states(head, head_lse, tail, tail_lse)
    # Each part is rounded to dtype before the merge: one more rounding than `whole`.
    assert_close(out, whole)
    assert_close(lse, whole_lse, **LSE_TOL)

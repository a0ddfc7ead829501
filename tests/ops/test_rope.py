"""rope and qk_norm_rope against stagewise.ops.reference.

Both rotation styles, full and partial rotary dims, a float32 or same-dtype
cos/sin cache, int32 and int64 positions, more q heads than k heads, and q/k
whose tokens or heads are strided. Both ops work in place, so the reference
runs first on clones. Out-of-range positions raise before anything is written.
"""

from __future__ import annotations

import platform

import pytest
import torch

import stagewise.ops as ops
from helpers.kernels import DTYPES, assert_close, strided
from stagewise.ops import reference

EPS = 1e-6
MAX_POSITION = 300
NUM_Q_HEADS, NUM_K_HEADS = 4, 2
TOKENS = [0, 1, 3, 17, 200]
# (head_dim, rotary_dim): full rotary, half of 128, and a partial 64-dim head.
DIMS = [(128, 128), (128, 64), (64, 32)]


def _heads(tokens: int, heads: int, head_dim: int, dtype, device, layout: str) -> torch.Tensor:
    """[tokens, heads, head_dim]: contiguous, padded after every token, or padded after every head."""
    x = torch.randn(tokens, heads, head_dim, dtype=dtype, device=device)
    if layout == "strided_tokens":
        return strided(x)
    if layout == "strided_heads":
        buf = torch.full((tokens, heads, head_dim + 5), float("nan"), dtype=dtype, device=device)
        view = buf[..., :head_dim]
        view.copy_(x)
        return view
    return x


def _cos_sin_cache(rotary_dim: int, dtype, device) -> torch.Tensor:
    """[MAX_POSITION, rotary_dim]: cos of the angles in the first half of the columns, sin in the second."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(MAX_POSITION, dtype=torch.float64).unsqueeze(1) * inv_freq
    return torch.cat([angles.cos(), angles.sin()], dim=1).to(dtype=dtype, device=device)


def _inputs(tokens, dims, dtype, cache_dtype, position_dtype, layout, device):
    head_dim, rotary_dim = dims
    q = _heads(tokens, NUM_Q_HEADS, head_dim, dtype, device, layout)
    k = _heads(tokens, NUM_K_HEADS, head_dim, dtype, device, layout)
    positions = torch.randint(0, MAX_POSITION, (tokens,), dtype=position_dtype, device=device)
    cache = _cos_sin_cache(rotary_dim, dtype if cache_dtype == "same" else torch.float32, device)
    return q, k, positions, cache


def _id(dtype, is_neox, dims, cache_dtype) -> str:
    return f"{str(dtype)[6:]}-{'neox' if is_neox else 'gptj'}-d{dims[0]}r{dims[1]}-cache_{cache_dtype}"


# Every dtype x style x (head_dim, rotary_dim) x cache dtype, over all token counts
# (contiguous q/k, int64 positions) ...
SWEEP = [
    pytest.param(dtype, is_neox, dims, cache_dtype, tokens, torch.int64, "contiguous",
                 id=f"{_id(dtype, is_neox, dims, cache_dtype)}-T{tokens}")
    for dtype in DTYPES
    for is_neox in (True, False)
    for dims in DIMS
    for cache_dtype in ("float32", "same")
    for tokens in TOKENS
]
# ... and every layout x position dtype, at 17 tokens with partial rotary.
SWEEP += [
    pytest.param(dtype, is_neox, (128, 64), cache_dtype, 17, position_dtype, layout,
                 id=f"{_id(dtype, is_neox, (128, 64), cache_dtype)}-{str(position_dtype)[6:]}-{layout}")
    for dtype in DTYPES
    for is_neox in (True, False)
    for cache_dtype in ("float32", "same")
    for position_dtype in (torch.int32, torch.int64)
    for layout in ("strided_tokens", "strided_heads")
]
ARGS = "dtype,is_neox,dims,cache_dtype,tokens,position_dtype,layout"


@pytest.mark.parametrize(ARGS, SWEEP)
def test_rope(device, dtype, is_neox, dims, cache_dtype, tokens, position_dtype, layout):
    q, k, positions, cache = _inputs(tokens, dims, dtype, cache_dtype, position_dtype, layout, device)
    expected_q, expected_k = reference.rope(q.clone(), k.clone(), positions, cache, is_neox)

    ops.rope(q, k, positions, cache, is_neox)

    assert_close(q, expected_q)
    assert_close(k, expected_k)
    # Features past rotary_dim are copied untouched by the reference: they must match bit for bit.
    rot = dims[1]
    torch.testing.assert_close(q[..., rot:], expected_q[..., rot:], rtol=0, atol=0)
    torch.testing.assert_close(k[..., rot:], expected_k[..., rot:], rtol=0, atol=0)


@pytest.mark.parametrize(ARGS, SWEEP)
def test_qk_norm_rope(device, dtype, is_neox, dims, cache_dtype, tokens, position_dtype, layout):
    q, k, positions, cache = _inputs(tokens, dims, dtype, cache_dtype, position_dtype, layout, device)
    q_weight = torch.randn(dims[0], dtype=dtype, device=device)
    k_weight = torch.randn(dims[0], dtype=dtype, device=device)
    expected_q, expected_k = reference.qk_norm_rope(q.clone(), k.clone(), q_weight, k_weight, positions, cache, EPS, is_neox)

    ops.qk_norm_rope(q, k, q_weight, k_weight, positions, cache, EPS, is_neox)

    assert_close(q, expected_q)
    assert_close(k, expected_k)


@pytest.mark.parametrize("layout", ["contiguous", "strided_heads"])
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_unit_offset(device, dtype, is_neox, dims, layout):
    # Gemma's per-head norm (times 1 + w, rounded once) before the rotation.
    q, k, positions, cache = _inputs(17, dims, dtype, "float32", torch.int64, layout, device)
    q_weight = torch.randn(dims[0], dtype=dtype, device=device)
    k_weight = torch.randn(dims[0], dtype=dtype, device=device)
    expected_q, expected_k = reference.qk_norm_rope(q.clone(), k.clone(), q_weight, k_weight, positions, cache, EPS,
                                                    is_neox, unit_offset=True)

    ops.qk_norm_rope(q, k, q_weight, k_weight, positions, cache, EPS, is_neox, unit_offset=True)

    assert_close(q, expected_q)
    assert_close(k, expected_k)


# On x86-64 the kernel's ISA copies have no FMA, so like the reference it rounds
# x1 * cos, x2 * sin and their difference separately; where FMA is the default
# (aarch64, CUDA) the compiler may fuse them, one float32 rounding fewer.
EXACT_ROTATION = platform.machine() in ("x86_64", "AMD64")


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_rotates_the_rounded_norm(device, dtype, is_neox):
    # Small integer inputs make the per-head statistics exact in float32, so kernel and
    # reference normalise identically; the rotation must then start from the normed
    # values rounded to dtype (rope.h). Rotating the unrounded values instead is off by
    # an ulp here and there, within the tolerance of the other tests.
    q = torch.randint(-8, 9, (33, NUM_Q_HEADS, 128), device=device).to(dtype)
    k = torch.randint(-8, 9, (33, NUM_K_HEADS, 128), device=device).to(dtype)
    q_weight, k_weight = torch.randn(128, device=device).to(dtype), torch.randn(128, device=device).to(dtype)
    positions = torch.randint(0, MAX_POSITION, (33,), device=device)
    cache = _cos_sin_cache(96, torch.float32, device)
    expected_q, expected_k = reference.qk_norm_rope(q.clone(), k.clone(), q_weight, k_weight, positions, cache, EPS, is_neox)

    ops.qk_norm_rope(q, k, q_weight, k_weight, positions, cache, EPS, is_neox)

    tol = dict(rtol=0, atol=0) if device == "cpu" and EXACT_ROTATION else {}
    assert_close(q, expected_q, **tol)
    assert_close(k, expected_k, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_position_zero_is_identity(device, dtype):
    # cos(0) = 1, sin(0) = 0: an independent check that does not go through the reference.
    q = torch.randn(3, NUM_Q_HEADS, 64, dtype=dtype, device=device)
    k = torch.randn(3, NUM_K_HEADS, 64, dtype=dtype, device=device)
    q0, k0 = q.clone(), k.clone()

    ops.rope(q, k, torch.zeros(3, dtype=torch.int64, device=device), _cos_sin_cache(64, torch.float32, device), True)

    torch.testing.assert_close(q, q0, rtol=0, atol=0)
    torch.testing.assert_close(k, k0, rtol=0, atol=0)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rope_rotates_the_documented_pairs(device, is_neox):
    # One head, rotary_dim 4: pairs (0, 2), (1, 3) for NeoX and (0, 1), (2, 3) for GPT-J,
    # written out by hand with cos = 0.6, sin = 0.8 for both pairs.
    q = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 5.0]]], device=device)
    k = q.clone()
    cache = torch.tensor([[0.6, 0.6, 0.8, 0.8]], device=device)
    if is_neox:  # x1' = x1 c - x2 s, x2' = x2 c + x1 s for (x1, x2) = (1, 3) and (2, 4)
        expected = [1 * 0.6 - 3 * 0.8, 2 * 0.6 - 4 * 0.8, 3 * 0.6 + 1 * 0.8, 4 * 0.6 + 2 * 0.8, 5.0]
    else:  # for (x1, x2) = (1, 2) and (3, 4)
        expected = [1 * 0.6 - 2 * 0.8, 2 * 0.6 + 1 * 0.8, 3 * 0.6 - 4 * 0.8, 4 * 0.6 + 3 * 0.8, 5.0]

    ops.rope(q, k, torch.zeros(1, dtype=torch.int32, device=device), cache, is_neox)

    assert_close(q, torch.tensor([[expected]], device=device))
    assert_close(k, torch.tensor([[expected]], device=device))


@pytest.mark.parametrize("bad", [-1, MAX_POSITION, 10**9])
@pytest.mark.parametrize("op", ["rope", "qk_norm_rope"])
def test_out_of_range_position(device, op, bad):
    q, k, positions, cache = _inputs(5, (64, 32), torch.float32, "float32", torch.int64, "contiguous", device)
    positions[3] = bad
    weight = torch.ones(64, device=device)
    q_before, k_before = q.clone(), k.clone()

    def call():
        if op == "rope":
            ops.rope(q, k, positions, cache, True)
        else:
            ops.qk_norm_rope(q, k, weight, weight, positions, cache, EPS, True)

    if device == "cuda":
        # The GPU cannot raise without a host sync: the token is left as it was (rope.h).
        call()
        torch.testing.assert_close(q[3], q_before[3], rtol=0, atol=0)
        torch.testing.assert_close(k[3], k_before[3], rtol=0, atol=0)
        return
    with pytest.raises(IndexError, match=rf"stagewise\.{op}: positions\[3\] = {bad} is out of range \[0, {MAX_POSITION}\)"):
        call()
    # Checked before anything is written: no token was touched.
    torch.testing.assert_close(q, q_before, rtol=0, atol=0)
    torch.testing.assert_close(k, k_before, rtol=0, atol=0)

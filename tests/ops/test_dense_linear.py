"""dense_linear against F.linear in float64.

The float32 kernel runs every row count it takes (1 to dense_linear_max_rows()) and the BLAS GEMM
the rows past it; shapes are awkward: out_features below, at and past the kernel's 8 streams per
thread and not a multiple of them, in_features below one 16-float cache line, and off multiples of
it; with and without bias; inputs contiguous, row-strided and with leading dims; outputs poisoned
with NaN. What is left against float64 is float32 summation order, a few ulps of sum |x * w|. Every
ISA copy runs these cases (tests/ops/test_isa.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import stagewise.ops as ops
from helpers.kernels import poison_, strided

MAX_ROWS = ops.dense_linear_max_rows()
ROWS = sorted({*range(1, MAX_ROWS + 1), MAX_ROWS + 1, 2 * MAX_ROWS + 3})  # past MAX_ROWS: the GEMM
# (out_features, in_features): fewer rows than streams; whole tiles and rows left over; K < 16, K % 16 != 0.
SHAPES = [(1, 1), (5, 3), (7, 16), (8, 15), (17, 33), (40, 64), (67, 130), (129, 257), (300, 96)]


def _check(actual: torch.Tensor, x, w, bias) -> None:
    """float32 sums in any order stay within a few float32 ulps (2^-23) of sum |x * w| (16 allowed)."""
    x2, y = x.reshape(-1, x.shape[-1]).double(), actual.reshape(-1, w.shape[0]).double()
    expected = F.linear(x2, w.double(), None if bias is None else bias.double())
    scale = x2.abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    err = (y - expected).abs()
    bound = 16 * 2.0**-23 * scale
    assert torch.all(err <= bound), f"max error {err.max().item():.3g}, worst excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_dense_linear_float32(shape, rows):
    n, k = shape
    x, w = torch.randn(rows, k), torch.randn(n, k)
    bias = torch.randn(n) if rows % 2 else None
    out = poison_(torch.empty(rows, n))

    result = ops.dense_linear(x, w, bias, out=out)

    assert result is out
    _check(out, x, w, bias)


@pytest.mark.parametrize("rows", [1, MAX_ROWS, MAX_ROWS + 5])
def test_dense_linear_strided_rows_and_leading_dims(rows):
    n, k = 45, 70
    w, bias = torch.randn(n, k), torch.randn(n)
    x = strided(torch.randn(rows, k), pad=5)  # rows k + 5 floats apart
    out = strided(poison_(torch.empty(rows, n)), pad=3)
    ops.dense_linear(x, w, bias, out=out)
    _check(out, x, w, bias)
    assert out.as_strided((rows, 3), (n + 3, 1), n).isnan().all()  # the padding between rows: untouched

    x3 = torch.randn(2, rows, k)
    y3 = ops.dense_linear(x3, w)
    assert y3.shape == (2, rows, n)
    _check(y3, x3, w, None)


def test_dense_linear_one_row_vector():
    x, w = torch.randn(33), torch.randn(9, 33)
    y = ops.dense_linear(x, w)
    assert y.shape == (9,)
    _check(y, x, w, None)


def test_dense_linear_weights_far_past_the_caches():
    """A decode-sized matrix (48 MB): every thread's 8 streams and its prefetches run to their ends."""
    w, x, bias = torch.randn(6144 + 5, 2048), torch.randn(1, 2048), torch.randn(6144 + 5)
    _check(ops.dense_linear(x, w, bias), x, w, bias)


def test_dense_linear_same_bits_for_any_thread_count():
    """Each output is summed by one thread in the kernel's order: the thread count changes no bit."""
    x, w, bias = torch.randn(MAX_ROWS, 256), torch.randn(1000, 256), torch.randn(1000)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.dense_linear(x, w, bias)
        torch.set_num_threads(max(2, threads))
        many = ops.dense_linear(x, w, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("rows", [1, 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_linear_half_dtypes_are_f_linear(dtype, rows):
    """float16 and bfloat16 take the same BLAS GEMM as F.linear: the same bits."""
    x, w, bias = torch.randn(rows, 64).to(dtype), torch.randn(24, 64).to(dtype), torch.randn(24).to(dtype)
    assert torch.equal(ops.dense_linear(x, w, bias), F.linear(x, w, bias))
    assert torch.equal(ops.dense_linear(x, w), F.linear(x, w))


def test_dense_linear_empty():
    w = torch.randn(5, 16)
    assert ops.dense_linear(torch.randn(0, 16), w).shape == (0, 5)
    assert ops.dense_linear(torch.randn(3, 16), torch.randn(0, 16)).shape == (3, 0)


def test_dense_linear_bad_inputs():
    x, w = torch.randn(3, 16), torch.randn(4, 16)
    with pytest.raises(TypeError, match="argument 'x' must be float32, float16 or bfloat16, got float64"):
        ops.dense_linear(x.double(), w.double())
    with pytest.raises(TypeError, match=r"argument 'weight' must have the dtype of 'x' \(float32\), got bfloat16"):
        ops.dense_linear(x, w.bfloat16())
    with pytest.raises(ValueError, match=r"argument 'weight' dim 1 \(in_features, x's last dim\) must be 16, got 15"):
        ops.dense_linear(x, torch.randn(4, 15))
    with pytest.raises(ValueError, match="argument 'weight' must be contiguous"):
        ops.dense_linear(x, torch.randn(16, 4).T)
    with pytest.raises(ValueError, match="argument 'x' must have a contiguous last dim"):
        ops.dense_linear(torch.randn(16, 3).T, w)
    with pytest.raises(ValueError, match="argument 'weight' must have in_features >= 1"):
        ops.dense_linear(torch.randn(3, 0), torch.randn(4, 0))
    with pytest.raises(ValueError, match=r"argument 'bias' dim 0 \(out_features\) must be 4, got 5"):
        ops.dense_linear(x, w, torch.randn(5))
    with pytest.raises(ValueError, match=r"argument 'out' must have shape \[3, 4\]"):
        ops.dense_linear(x, w, out=torch.empty(3, 5))
    with pytest.raises(NotImplementedError, match="stagewise.dense_linear: runs on the CPU only, got x on meta"):
        ops.dense_linear(x.to("meta"), w.to("meta"))


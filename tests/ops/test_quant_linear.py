"""quant_linear against a dequantisation written from the GGUF block layout (gguf.quants.dequantize).

Weights are real GGUF blocks made by gguf.quants.quantize from random matrices, random valid blocks
for the K-quants (tests/helpers/quant_cases.py), plus hand-built blocks for the layout itself; sizes are
awkward (in_features one block, odd block counts; output features not a multiple of any panel or
tile); batches 1, 3, 9 (the direct kernels' rows with AVX2 and AVX-512), 16 (the tile kernel's on
AVX2, the direct one's on AVX-512), 33, 60, 70 (the tile kernel's everywhere, whole and part groups
of rows: 60 leaves 28 rows for AVX-512's second group of 32; the baseline level takes every batch
there); a prompt of 300 rows (more than one block of packed rows); inputs contiguous, row-strided
and with leading dims; outputs poisoned with NaN. The reference is float64 over the gguf-dequantised
weights: what is left is float32 summation order, a few ulps of the sum of |x * w|. Every ISA copy
runs these cases (tests/ops/test_isa.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import stagewise.ops as ops
from helpers.kernels import poison_, strided
from helpers.quant_cases import QTYPES, dequantize as _dequantize, quantize as _quantize, shapes
from stagewise.ops import reference

CASES = [(name, shape) for name in QTYPES for shape in shapes(name)]
BATCHES = [1, 3, 9, 16, 33, 60, 70]  # from 10 (AVX2) or 28 (AVX-512) rows on, the tile kernel


def _expected(x, w, bias):
    y = x.double() @ w.double().T
    if bias is not None:
        y += bias.double()
    return y


def _check(actual: torch.Tensor, x, w, bias) -> None:
    """float32 sums in any order stay within a few float32 ulps (2^-23) of sum |x * w| (16 allowed);
    a half output then adds its one rounding (half an ulp of the value: 2^-9 bf16, 2^-12 fp16).
    Any device's result is checked on the CPU."""
    actual, x, bias = actual.cpu(), x.cpu(), None if bias is None else bias.cpu()
    scale = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    expected = _expected(x, w, bias)
    rounding = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[actual.dtype]
    err = (actual.double() - expected).abs()
    bound = 16 * 2.0**-23 * scale + rounding * expected.abs()
    assert torch.all(err <= bound), f"max error {err.max().item():.3g}, worst excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("name", QTYPES)
def test_reference_dequantize_matches_gguf(name):
    qweight = _quantize(name, *shapes(name)[2])
    torch.testing.assert_close(reference.dequantize(qweight, ops.QTYPES[name]), _dequantize(qweight, name),
                               rtol=0, atol=0)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{s[0]}x{s[1]}" for n, s in CASES])
def test_quant_linear_float32(name, shape, batch, device):
    qweight = _quantize(name, *shape)
    w = _dequantize(qweight, name)
    x = torch.randn(batch, shape[1])
    bias = torch.randn(shape[0]) if batch % 2 else None
    out = poison_(torch.empty(batch, shape[0], device=device))

    result = ops.quant_linear(x.to(device), qweight.to(device), ops.QTYPES[name],
                              None if bias is None else bias.to(device), out=out)

    assert result is out
    _check(out, x, w, bias)
    _check(reference.quant_linear(x, qweight, ops.QTYPES[name], bias), x, w, bias)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_prompt_splits_its_tiles_over_the_threads_in_inference_mode(threads):
    """A prompt's rows run the tile kernel, each thread its own tiles of weights (more tiles than
    threads, and a count that is not a multiple of them) over blocks of packed rows (300 rows: a
    whole block and part of one); under inference mode, as in a model, and the same bits at every
    thread count (each output is one thread's sum in one order), and a row's bits do not depend on
    the rows beside it (rows 250-289 alone: 40 rows, the tile kernel on every level)."""
    qweight = _quantize("Q4_1", 1010, 256)  # 85 tiles of 12 (AVX-512), 169 of 6; the last ones part full
    w, x, bias = _dequantize(qweight, "Q4_1"), torch.randn(300, 256), torch.randn(1010)
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one = ops.quant_linear(x, qweight, ops.QTYPES["Q4_1"], bias)
            torch.set_num_threads(threads)
            out = ops.quant_linear(x, qweight, ops.QTYPES["Q4_1"], bias)
            part = ops.quant_linear(x[250:290], qweight, ops.QTYPES["Q4_1"], bias)
    finally:
        torch.set_num_threads(before)
    _check(out, x, w, bias)
    assert torch.equal(out, one)
    assert torch.equal(part, out[250:290])


@pytest.mark.parametrize("rows", [16, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", QTYPES)
def test_quant_linear_half_activations(name, dtype, rows, device):
    n, k = shapes(name)[2]
    qweight = _quantize(name, n, k)
    x, bias = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)

    out = ops.quant_linear(x.to(device), qweight.to(device), ops.QTYPES[name], bias.to(device))

    assert out.dtype == dtype
    _check(out, x, _dequantize(qweight, name), bias)


@pytest.mark.parametrize("rows", [16, 40])
@pytest.mark.parametrize("name", QTYPES)
def test_quant_linear_strided_rows_and_leading_dims(name, rows, device):
    n, k = shapes(name)[2]
    qweight = _quantize(name, n, k).to(device)
    w = _dequantize(qweight.cpu(), name)
    x = strided(torch.randn(rows, k, device=device), pad=5)  # rows k + 5 floats apart
    out = strided(poison_(torch.empty(rows, n, device=device)), pad=3)
    bias = torch.randn(n, device=device)
    ops.quant_linear(x, qweight, ops.QTYPES[name], bias, out=out)
    _check(out, x, w, bias)

    x3 = torch.randn(2, rows // 2, k, device=device)
    y3 = ops.quant_linear(x3, qweight, ops.QTYPES[name])
    assert y3.shape == (2, rows // 2, n)
    _check(y3.reshape(rows, n), x3.reshape(rows, k), w, None)


def test_quant_linear_hand_built_blocks():
    """The layout itself: Q4_1 block with d=0.5, m=-1, nibbles i % 16 (low) and 15 - i % 16 (high)."""
    d, m = np.float16(0.5).tobytes(), np.float16(-1.0).tobytes()
    qs = bytes((i % 16) | ((15 - i % 16) << 4) for i in range(16))
    qweight = torch.tensor(list(d + m + qs), dtype=torch.uint8).reshape(1, 20)
    weights = [0.5 * (i % 16) - 1 for i in range(16)] + [0.5 * (15 - i % 16) - 1 for i in range(16)]
    x = torch.zeros(1, 32)
    for i in range(32):
        x.zero_()
        x[0, i] = 1.0
        assert ops.quant_linear(x, qweight, ops.QTYPES["Q4_1"]).item() == weights[i]


def test_quant_linear_empty():
    qweight = _quantize("Q8_0", 5, 64)
    assert ops.quant_linear(torch.randn(0, 64), qweight, 8).shape == (0, 5)


def test_quant_linear_bad_inputs():
    qweight = _quantize("Q4_1", 8, 64)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match=r"'qtype' must be a GGML type id of Q4_0 \(2\), Q4_1 \(3\), Q8_0 \(8\), "
                                         r"Q4_K \(12\) or Q6_K \(14\), got 13"):
        ops.quant_linear(x, qweight, 13)
    with pytest.raises(TypeError, match="argument 'x' must be float32, float16 or bfloat16, got int32"):
        ops.quant_linear(x.int(), qweight, 3)
    with pytest.raises(TypeError, match="argument 'qweight' must be uint8"):
        ops.quant_linear(x, qweight.view(torch.int8), 3)
    with pytest.raises(ValueError, match=r"'qweight' dim 1 \(bytes per row\) must be in_features / 32 \* 20 = 40 for Q4_1"):
        ops.quant_linear(torch.randn(3, 64), qweight[:, :30].contiguous(), 3)
    with pytest.raises(ValueError, match=r"bytes per row\) must be in_features / 32 \* 34 = 68 for Q8_0"):
        ops.quant_linear(x, qweight, 8)
    with pytest.raises(ValueError, match="last dim \\(in_features\\) must be a positive multiple of Q4_1's block of 32"):
        ops.quant_linear(torch.randn(3, 48), qweight, 3)
    with pytest.raises(ValueError, match="last dim \\(in_features\\) must be a positive multiple of Q4_K's block of 256"):
        ops.quant_linear(x, qweight, 12)
    with pytest.raises(ValueError, match="'qweight' must have 2 dims"):
        ops.quant_linear(x, qweight.reshape(-1), 3)
    with pytest.raises(ValueError, match="'qweight' must be contiguous"):
        ops.quant_linear(torch.randn(3, 32), qweight[:, ::2], 3)
    with pytest.raises(ValueError, match="'x' must have a contiguous last dim"):
        ops.quant_linear(torch.randn(64, 3).T, qweight, 3)
    with pytest.raises(ValueError, match=r"argument 'bias' dim 0 \(out_features"):
        ops.quant_linear(x, qweight, 3, torch.randn(7))
    with pytest.raises(TypeError, match="argument 'bias' must have the dtype of 'x'"):
        ops.quant_linear(x, qweight, 3, torch.randn(8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"argument 'out' must have shape \[3, 8\]"):
        ops.quant_linear(x, qweight, 3, out=torch.empty(3, 9))


def check_every_case() -> None:
    """Every type, shape and batch above against float64 (run under each ISA by test_isa.py)."""
    for name, shape in CASES:
        qweight = _quantize(name, *shape)
        w = _dequantize(qweight, name)
        for batch in BATCHES:
            x = torch.randn(batch, shape[1])
            bias = torch.randn(shape[0]) if batch % 2 else None
            _check(ops.quant_linear(x, qweight, ops.QTYPES[name], bias, out=poison_(torch.empty(batch, shape[0]))),
                   x, w, bias)

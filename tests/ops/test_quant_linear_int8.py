"""quant_linear_int8, the reduced-precision mode: x quantised to int8 per block of 32, integer block
products with the GGUF weight blocks (include/stagewise/quant.h), packed once by quant_pack_int8.

Against its pure-torch reference (stagewise.ops.reference.quant_linear_int8, the same maths written
plainly): the int8 activations must be identical (ties to even), so what is left is float32 rounding
of the block terms and their summation order — a few ulps of sum |x_q * w|. Against the exact op
(float64 over gguf's own dequantisation): within the error of quantising x, at most d_x / 2 per
value. The tie-breaking and the layout are pinned by hand-built blocks. Every ISA copy of the
kernel runs these cases (tests/ops/test_isa.py). Sizes are awkward (one block; output features
not a multiple of the 16-row panels; 1 to 33 rows, past every pass of rows).
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
BATCHES = [1, 3, 9, 33]
ULP = 2.0**-23


def _int8(x, qweight, name, bias=None, out=None):
    """The op over the packed rows, as a model runs it."""
    qtype = ops.QTYPES[name]
    return ops.quant_linear_int8(x, ops.quant_pack_int8(qweight, qtype), qtype, qweight.shape[0], bias, out=out)


def _activations(rows: int, in_features: int) -> torch.Tensor:
    """Activations like a transformer's: mostly small, a few outlier channels."""
    x = torch.randn(rows, in_features)
    x[:, :: max(1, in_features // 5)] *= 20
    return x


def _check_vs_reference(actual, x, qweight, name, bias) -> None:
    """Same int8 activations, same block terms: float32 rounding only, 16 ulps of sum |x_q * w|
    (plus half an ulp of the value for a half output)."""
    xq, d = reference.quantize_blocks_int8(x.float().reshape(-1, x.shape[-1]))
    x_hat = (xq * d).reshape(-1, x.shape[-1]).double()
    w = _dequantize(qweight, name).double()
    scale = x_hat.abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    fbias = None if bias is None else bias.float()  # the reference in float32: the op's rounding is the only one
    expected = reference.quant_linear_int8(x.float(), qweight, ops.QTYPES[name], fbias).double().reshape(scale.shape)
    rounding = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[actual.dtype]
    err = (actual.double().reshape(scale.shape) - expected).abs()
    bound = 16 * ULP * scale + rounding * expected.abs()
    assert torch.all(err <= bound), f"max error {err.max().item():.3g}, worst excess {(err - bound).max().item():.3g}"


def _check_vs_exact(actual, x, qweight, name, bias) -> None:
    """Quantising x moves each value by at most d_x / 2 = max|x block| / 254: the output moves by
    at most that times |w|, summed; float32 sums add a few ulps of sum |x * w| on both sides."""
    x2 = x.double().reshape(-1, x.shape[-1])
    w = _dequantize(qweight, name).double()
    half_step = (x2.reshape(x2.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32)
    bound = half_step.reshape(x2.shape) @ w.abs().T + 32 * ULP * (x2.abs() @ w.abs().T + 1)
    exact = x2 @ w.T + (0 if bias is None else bias.double())
    err = (actual.double().reshape(exact.shape) - exact).abs()
    assert torch.all(err <= bound), f"max error {err.max().item():.3g}, worst excess {(err - bound).max().item():.3g}"


def test_reference_quantizes_with_ties_to_even():
    x = torch.zeros(1, 64)
    x[0, :7] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.49])  # d = 1: the ties are x itself
    q, d = reference.quantize_blocks_int8(x)
    assert d.flatten().tolist() == [1.0, 0.0]  # the second block is all zeros: scale 0, quants 0
    assert q[0, 0, :7].tolist() == [127, 0, 2, 2, 0, -2, 3] and not q[0, 0, 7:].any() and not q[0, 1].any()


def test_hand_built_blocks():
    """Q8_0 block of ones with d = 1: the output is the sum of the int8 activations, so 132 where
    the exact sum is 132.99; Q4_1 block d = 0.5, m = -1, nibbles i % 16 (low) and 15 - i % 16 (high)."""
    x = torch.zeros(1, 32)
    x[0, :7] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.49])
    ones = torch.tensor(list(np.float16(1.0).tobytes() + bytes([1] * 32)), dtype=torch.uint8).reshape(1, 34)
    assert _int8(x, ones, "Q8_0").item() == 132.0
    assert ops.quant_linear(x, ones, ops.QTYPES["Q8_0"]).item() == pytest.approx(132.99)

    d, m = np.float16(0.5).tobytes(), np.float16(-1.0).tobytes()
    qs = bytes((i % 16) | ((15 - i % 16) << 4) for i in range(16))
    q41 = torch.tensor(list(d + m + qs), dtype=torch.uint8).reshape(1, 20)
    nibbles = [i % 16 for i in range(16)] + [15 - i % 16 for i in range(16)]
    xq = [127, 0, 2, 2, 0, -2, 3] + [0] * 25  # as quantised above, d_x = 1
    expected = 0.5 * sum(n * v for n, v in zip(nibbles, xq)) - 1.0 * sum(xq)
    assert _int8(x, q41, "Q4_1").item() == expected


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{s[0]}x{s[1]}" for n, s in CASES])
def test_int8_matches_reference_and_stays_near_exact(name, shape, batch):
    qweight = _quantize(name, *shape)
    x = _activations(batch, shape[1])
    bias = torch.randn(shape[0]) if batch % 2 else None
    out = poison_(torch.empty(batch, shape[0]))

    result = _int8(x, qweight, name, bias, out=out)

    assert result is out
    _check_vs_reference(out, x, qweight, name, bias)
    _check_vs_exact(out, x, qweight, name, bias)
    _check_vs_exact(reference.quant_linear_int8(x, qweight, ops.QTYPES[name], bias), x, qweight, name, bias)


def test_int8_is_not_the_exact_op():
    """The mode does change the maths: a guard against a silent fallback to quant_linear."""
    qweight = _quantize("Q4_1", 37, 224)
    x = _activations(16, 224)
    assert not torch.equal(_int8(x, qweight, "Q4_1"), ops.quant_linear(x, qweight, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", QTYPES)
def test_int8_half_activations(name, dtype):
    n, k = shapes(name)[2]
    qweight = _quantize(name, n, k)
    x, bias = _activations(16, k).to(dtype), torch.randn(n).to(dtype)

    out = _int8(x, qweight, name, bias)

    assert out.dtype == dtype
    _check_vs_reference(out, x, qweight, name, bias)


@pytest.mark.parametrize("name", QTYPES)
def test_int8_strided_rows_and_leading_dims(name):
    n, k = shapes(name)[2]
    qweight = _quantize(name, n, k)
    x = strided(_activations(12, k), pad=5)
    out = strided(poison_(torch.empty(12, n)), pad=3)
    _int8(x, qweight, name, out=out)
    _check_vs_reference(out, x, qweight, name, None)

    x3 = _activations(6, k).reshape(2, 3, k)
    y3 = _int8(x3, qweight, name)
    assert y3.shape == (2, 3, n)
    _check_vs_reference(y3, x3, qweight, name, None)


def check_every_case() -> None:
    """Every qtype, shape and batch above against the reference (run under each ISA by test_isa.py)."""
    for name, shape in CASES:
        qweight = _quantize(name, *shape)
        for batch in BATCHES:
            x = _activations(batch, shape[1])
            bias = torch.randn(shape[0]) if batch % 2 else None
            out = poison_(torch.empty(batch, shape[0]))
            _check_vs_reference(_int8(x, qweight, name, bias, out=out), x, qweight, name, bias)


@pytest.mark.parametrize("name", QTYPES)
def test_pack_layout(name):
    """The packed panels: 16 rows a panel (the last one padded with zero rows), one record per GGUF
    block of them, and the record sizes of csrc/cpu/quant_pack.h."""
    qtype = ops.QTYPES[name]
    n, k = shapes(name)[2]
    packed = ops.quant_pack_int8(_quantize(name, n, k), qtype)
    blocks = k // ops.QUANT_BLOCK_WEIGHTS[qtype]
    assert packed.dtype == torch.uint8 and packed.shape == ((n + 15) // 16, blocks * ops.QUANT_PACK_RECORD_BYTES[qtype])
    assert ops.QUANT_PACK_RECORD_BYTES[qtype] in (16 * ops.QUANT_BLOCK_BYTES[qtype], 16 * 144 + 64)  # Q4_K: scales as bytes
    # Zero rows pack into zero bytes, and a panel's rows move with it: the packing of rows 16-31 is panel 1.
    assert not ops.quant_pack_int8(torch.zeros(3, blocks * ops.QUANT_BLOCK_BYTES[qtype], dtype=torch.uint8), qtype).any()
    qweight = _quantize(name, 32, k, seed=1)
    assert torch.equal(ops.quant_pack_int8(qweight, qtype)[1:], ops.quant_pack_int8(qweight[16:].contiguous(), qtype))


def test_int8_empty_and_bad_inputs():
    qweight = _quantize("Q4_1", 8, 64)
    packed = ops.quant_pack_int8(qweight, 3)
    assert ops.quant_linear_int8(torch.randn(0, 64), packed, 3, 8).shape == (0, 8)
    with pytest.raises(ValueError, match=r"^stagewise\.quant_linear_int8: argument 'qtype' must be a GGML type id"):
        ops.quant_linear_int8(torch.randn(3, 64), packed, 13, 8)
    with pytest.raises(ValueError, match=r"^stagewise\.quant_linear_int8: argument 'qweight' must be the packed panels "
                                         r"\[ceil\(out_features / 16\), in_features / 32 \* 544\] = \[1, 1088\] for Q8_0"):
        ops.quant_linear_int8(torch.randn(3, 64), packed, 8, 8)
    with pytest.raises(ValueError, match=r"'qweight' must be the packed panels .* = \[2, 640\] for Q4_1 with "
                                         r"in_features=64 and out_features=17"):
        ops.quant_linear_int8(torch.randn(3, 64), packed, 3, 17)
    with pytest.raises(ValueError, match=r"^stagewise\.quant_pack_int8: argument 'qtype' must be a GGML type id"):
        ops.quant_pack_int8(qweight, 13)
    with pytest.raises(ValueError, match=r"^stagewise\.quant_pack_int8: argument 'qweight' must be contiguous "
                                         r"\[rows, blocks \* 34\] \(Q8_0 blocks\)"):
        ops.quant_pack_int8(qweight[:, :30].contiguous(), 8)
    with pytest.raises(NotImplementedError, match="the int8 mode runs on the CPU only"):
        ops.quant_linear_int8(torch.randn(3, 64, device="meta"), packed.to("meta"), 3, 8)

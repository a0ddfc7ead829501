"""quant_linear_int8, the reduced-precision mode: x quantised to int8 per block of 32, integer block
products with the GGUF weight blocks (include/stagewise/quant.h).

Against its pure-torch reference (stagewise.ops.reference.quant_linear_int8, the same maths written
plainly): the int8 activations must be identical (ties to even), so what is left is float32 rounding
of the block terms and their summation order — a few ulps of sum |x_q * w|. Against the exact op
(float64 over gguf's own dequantisation): within the error of quantising x, at most d_x / 2 per
value. The tie-breaking and the layout are pinned by hand-built blocks. Every ISA copy of the
kernel runs (STAGEWISE_INT8_ISA picks a lesser one in a subprocess). Sizes are awkward (one block;
output features not a multiple of the 16- or 8-feature panels; 1 to 33 rows, past the 8-row pass).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import stagewise.ops as ops
from conftest import poison_, strided
from stagewise.ops import reference

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]
SHAPES = [(1, 32), (7, 96), (37, 224), (19, 1536)]  # (out_features, in_features)
BATCHES = [1, 3, 9, 33]
ULP = 2.0**-23


def _quantize(name: str, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[name]).copy())


def _dequantize(qweight: torch.Tensor, name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(qweight.numpy(), gguf.GGMLQuantizationType[name]).copy())


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
    assert ops.quant_linear_int8(x, ones, ops.QTYPES["Q8_0"]).item() == 132.0
    assert ops.quant_linear(x, ones, ops.QTYPES["Q8_0"]).item() == pytest.approx(132.99)

    d, m = np.float16(0.5).tobytes(), np.float16(-1.0).tobytes()
    qs = bytes((i % 16) | ((15 - i % 16) << 4) for i in range(16))
    q41 = torch.tensor(list(d + m + qs), dtype=torch.uint8).reshape(1, 20)
    nibbles = [i % 16 for i in range(16)] + [15 - i % 16 for i in range(16)]
    xq = [127, 0, 2, 2, 0, -2, 3] + [0] * 25  # as quantised above, d_x = 1
    expected = 0.5 * sum(n * v for n, v in zip(nibbles, xq)) - 1.0 * sum(xq)
    assert ops.quant_linear_int8(x, q41, ops.QTYPES["Q4_1"]).item() == expected


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", QTYPES)
def test_int8_matches_reference_and_stays_near_exact(name, shape, batch):
    qweight = _quantize(name, *shape)
    x = _activations(batch, shape[1])
    bias = torch.randn(shape[0]) if batch % 2 else None
    out = poison_(torch.empty(batch, shape[0]))

    result = ops.quant_linear_int8(x, qweight, ops.QTYPES[name], bias, out=out)

    assert result is out
    _check_vs_reference(out, x, qweight, name, bias)
    _check_vs_exact(out, x, qweight, name, bias)
    _check_vs_exact(reference.quant_linear_int8(x, qweight, ops.QTYPES[name], bias), x, qweight, name, bias)


def test_int8_is_not_the_exact_op():
    """The mode does change the maths: a guard against a silent fallback to quant_linear."""
    qweight = _quantize("Q4_1", 37, 224)
    x = _activations(16, 224)
    assert not torch.equal(ops.quant_linear_int8(x, qweight, 3), ops.quant_linear(x, qweight, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", QTYPES)
def test_int8_half_activations(name, dtype):
    qweight = _quantize(name, 37, 224)
    x, bias = _activations(16, 224).to(dtype), torch.randn(37).to(dtype)

    out = ops.quant_linear_int8(x, qweight, ops.QTYPES[name], bias)

    assert out.dtype == dtype
    _check_vs_reference(out, x, qweight, name, bias)


@pytest.mark.parametrize("name", QTYPES)
def test_int8_strided_rows_and_leading_dims(name):
    qweight = _quantize(name, 37, 96)
    x = strided(_activations(12, 96), pad=5)
    out = strided(poison_(torch.empty(12, 37)), pad=3)
    ops.quant_linear_int8(x, qweight, ops.QTYPES[name], out=out)
    _check_vs_reference(out, x, qweight, name, None)

    x3 = _activations(6, 96).reshape(2, 3, 96)
    y3 = ops.quant_linear_int8(x3, qweight, ops.QTYPES[name])
    assert y3.shape == (2, 3, 37)
    _check_vs_reference(y3, x3, qweight, name, None)


def check_every_case() -> None:
    """Every qtype, shape and batch above against the reference (run in the subprocesses below)."""
    for name in QTYPES:
        for shape in SHAPES:
            for batch in BATCHES:
                qweight = _quantize(name, *shape)
                x = _activations(batch, shape[1])
                bias = torch.randn(shape[0]) if batch % 2 else None
                _check_vs_reference(ops.quant_linear_int8(x, qweight, ops.QTYPES[name], bias), x, qweight, name, bias)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_lesser_isa_copies(isa):
    """The AVX2 and plain-loop copies, which this CPU would not pick (STAGEWISE_INT8_ISA is read once
    per process, hence a subprocess)."""
    here = Path(__file__).parent
    env = dict(os.environ, STAGEWISE_INT8_ISA=isa, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]))  # conftest
    code = "import torch; torch.set_num_threads(1); import test_quant_linear_int8 as t; t.check_every_case()"
    done = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_int8_empty_and_bad_inputs():
    qweight = _quantize("Q4_1", 8, 64)
    assert ops.quant_linear_int8(torch.randn(0, 64), qweight, 3).shape == (0, 8)
    with pytest.raises(ValueError, match=r"^stagewise\.quant_linear_int8: argument 'qtype' must be a GGML type id"):
        ops.quant_linear_int8(torch.randn(3, 64), qweight, 12)
    with pytest.raises(ValueError, match=r"^stagewise\.quant_linear_int8: argument 'qweight' dim 1 \(bytes per row\)"):
        ops.quant_linear_int8(torch.randn(3, 64), qweight, 8)
    with pytest.raises(NotImplementedError, match="the int8 mode runs on the CPU only"):
        ops.quant_linear_int8(torch.randn(3, 64, device="meta"), qweight.to("meta"), 3)

"""rms_norm and fused_add_rms_norm against stagewise.ops.reference.

Inputs cover every dtype, awkward hidden sizes (odd, prime, not a multiple of
any vector width, and larger than one kernel block), 0/1/few/many rows, rows
with a stride and leading dims that collapse into rows. Outputs are poisoned
with NaN first, so an element the kernel forgets fails the comparison; the
in-place op is compared with a reference computed first on clones.
"""

from __future__ import annotations

import pytest
import torch

import stagewise.ops as ops
from helpers.kernels import DTYPES, assert_close, poison_, strided
from stagewise.ops import reference

EPS = 1e-6
HIDDEN = [7, 83, 769, 5125]
ROWS = [0, 1, 3, 17, 200]


def _rows(rows: int, hidden: int, dtype, device, layout: str, second: bool = False) -> torch.Tensor:
    """[rows, hidden]; "mixed" makes the first tensor of a test strided and the second contiguous."""
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    return strided(x) if layout == "strided" or (layout == "mixed" and not second) else x


@pytest.mark.parametrize("layout", ["contiguous", "strided", "mixed"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(device, dtype, hidden, rows, layout):
    x = _rows(rows, hidden, dtype, device, layout)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    out = poison_(_rows(rows, hidden, dtype, device, layout, second=True))
    expected = reference.rms_norm(x, weight, EPS)
    x_before = x.clone()

    result = ops.rms_norm(x, weight, EPS, out=out)

    assert result is out
    assert_close(out, expected)
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)  # the input is only read


@pytest.mark.parametrize("shape", [(2, 3, 5, 83), (4, 1, 3, 769), (1, 1, 7), (0, 3, 7), (2, 0, 7)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_leading_dims(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device)
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    expected = reference.rms_norm(x, weight, EPS)

    out = ops.rms_norm(x, weight, EPS)

    assert out.shape == x.shape
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_leading_dims(device, dtype):
    # [2, 3, 83] whose 6 rows are padded: the leading dims still collapse into one strided row dim.
    x = strided(torch.randn(6, 83, dtype=dtype, device=device)).view(2, 3, 83)
    weight = torch.randn(83, dtype=dtype, device=device)
    out = poison_(strided(torch.empty(6, 83, dtype=dtype, device=device)).view(2, 3, 83))
    expected = reference.rms_norm(x, weight, EPS)

    ops.rms_norm(x, weight, EPS, out=out)

    assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_large_and_small_magnitudes(device, dtype):
    # Rows far from unit scale: the statistics must be taken in float32, not in dtype.
    scale = torch.tensor([1e-3, 1.0, 1e3], device=device).unsqueeze(1)
    x = (torch.randn(3, 769, device=device) * scale).to(dtype)
    weight = torch.randn(769, dtype=dtype, device=device)

    assert_close(ops.rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))


@pytest.mark.parametrize("layout", ["contiguous", "strided", "mixed"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(device, dtype, hidden, rows, layout):
    x = _rows(rows, hidden, dtype, device, layout)
    residual = _rows(rows, hidden, dtype, device, layout, second=True)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    expected_x, expected_residual = reference.fused_add_rms_norm(x.clone(), residual.clone(), weight, EPS)

    ops.fused_add_rms_norm(x, residual, weight, EPS)

    # The residual is one rounding of an exact sum: it must match bit for bit.
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    assert_close(x, expected_x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_leading_dims(device, dtype):
    x = torch.randn(2, 3, 5, 83, dtype=dtype, device=device)
    residual = torch.randn(2, 3, 5, 83, dtype=dtype, device=device)
    weight = torch.randn(83, dtype=dtype, device=device)
    expected_x, expected_residual = reference.fused_add_rms_norm(x.clone(), residual.clone(), weight, EPS)

    ops.fused_add_rms_norm(x, residual, weight, EPS)

    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    assert_close(x, expected_x)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_contract_is_exact(device, dtype, hidden):
    # With small integer inputs every sum of squares is exact in float32, so kernel
    # and reference compute the same inv_rms and must then round at the same places
    # (norm.h): y = T(T(x * inv_rms) * w). A kernel that skips the inner rounding,
    # or takes the statistics before rounding the residual, is off by an ulp here
    # and there, which the tolerance of the other tests would let through.
    x = torch.randint(-8, 9, (64, hidden), device=device).to(dtype)
    residual = torch.randint(-8, 9, (64, hidden), device=device).to(dtype)
    weight = torch.randn(hidden, device=device).to(dtype)
    expected = reference.rms_norm(x, weight, EPS)
    expected_x, expected_residual = reference.fused_add_rms_norm(x.clone(), residual.clone(), weight, EPS)

    out = ops.rms_norm(x, weight, EPS)
    ops.fused_add_rms_norm(x, residual, weight, EPS)

    # Exact on the CPU. CUDA's rsqrt need not be correctly rounded, so there inv_rms
    # itself may differ by an ulp and the usual tolerance applies.
    tol = dict(rtol=0, atol=0) if device == "cpu" else {}
    assert_close(out, expected, **tol)
    assert_close(x, expected_x, **tol)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [0, 1, 17, 200])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_offset(device, dtype, hidden, rows):
    # Gemma's norm: times 1 + w, rounded once; the plain and the fused op, strided rows.
    x = _rows(rows, hidden, dtype, device, "mixed")
    residual = _rows(rows, hidden, dtype, device, "mixed", second=True)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    expected = reference.rms_norm(x, weight, EPS, unit_offset=True)
    expected_x, expected_residual = reference.fused_add_rms_norm(x.clone(), residual.clone(), weight, EPS, True)

    out = ops.rms_norm(x, weight, EPS, unit_offset=True, out=poison_(torch.empty_like(x)))
    ops.fused_add_rms_norm(x, residual, weight, EPS, unit_offset=True)

    assert_close(out, expected)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    assert_close(x, expected_x)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_offset_rounding_is_exact(device, dtype, hidden):
    # As test_rounding_contract_is_exact, for y = T(x * inv_rms * (1 + w)): a kernel that rounds
    # the normed value first (Llama's contract), or adds 1 to w in dtype, is off here and there.
    x = torch.randint(-8, 9, (64, hidden), device=device).to(dtype)
    residual = torch.randint(-8, 9, (64, hidden), device=device).to(dtype)
    weight = (torch.randn(hidden, device=device) * 0.1).to(dtype)
    expected = reference.rms_norm(x, weight, EPS, unit_offset=True)
    expected_x, expected_residual = reference.fused_add_rms_norm(x.clone(), residual.clone(), weight, EPS, True)

    out = ops.rms_norm(x, weight, EPS, unit_offset=True)
    ops.fused_add_rms_norm(x, residual, weight, EPS, unit_offset=True)

    tol = dict(rtol=0, atol=0) if device == "cpu" else {}
    assert_close(out, expected, **tol)
    assert_close(x, expected_x, **tol)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_offset_reference_is_gemmas(dtype):
    # The reference is transformers' Gemma3RMSNorm, bit for bit (the contract the kernels follow).
    gemma = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    x = torch.randn(9, 769).to(dtype)
    norm = gemma.Gemma3RMSNorm(769, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(769) * 0.5)
        expected = norm(x)
    torch.testing.assert_close(reference.rms_norm(x, norm.weight.detach(), EPS, unit_offset=True), expected,
                               rtol=0, atol=0)

"""Shared fixtures: devices (CUDA marked and skipped without a GPU), dtypes,
per-dtype tolerances, per-test seeding and output poisoning; and, at the end of a run, the list of
documentation examples that did not run."""

from __future__ import annotations

import zlib

import pytest
import torch

import stagewise.ops  # noqa: F401  (registers torch.ops.stagewise)

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


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs per test, reproducible from the test's id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


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


def pytest_terminal_summary(terminalreporter) -> None:
    """Lists the documentation examples that did not run here, and why (tests/docs/test_examples.py)."""
    reasons = []
    for report in terminalreporter.stats.get("skipped", []):
        if "tests/docs/test_examples.py::test_example" not in report.nodeid:
            continue
        longrepr = report.longrepr
        reasons.append(longrepr[2].removeprefix("Skipped: ") if isinstance(longrepr, tuple) else str(longrepr))
    if reasons:
        terminalreporter.write_sep("-", f"documentation examples not run here ({len(reasons)})")
        for reason in reasons:
            terminalreporter.write_line(reason)

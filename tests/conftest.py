"""Fixtures every test gets: the device parameter (:data:`helpers.kernels.DEVICES`), per-test
seeding; and, at the end of a run, the list of documentation examples that did not run. A run
started in the background of a shell inherits Ctrl-C ignored, and so would the processes the
Ctrl-C tests start: the default handler is put back first.

Shared helpers live in the ``helpers`` package beside this file (``from helpers.kernels import
assert_close``); pytest puts this folder on ``sys.path`` because this file is here."""

from __future__ import annotations

import signal
import zlib

import pytest
import torch

import stagewise.ops  # noqa: F401  (registers torch.ops.stagewise)
from helpers.kernels import DEVICES

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs per test, reproducible from the test's id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


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

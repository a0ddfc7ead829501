"""What every suite of ``stagewise bench`` shares on its command line: ``--tiny`` (and
``STAGEWISE_BENCH_TINY``), ``--threads``, ``--out``; and ``--device``, ``--quick`` for the suites
that take them. :func:`stagewise.bench.cli.main` applies them before a suite runs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

TINY_ENV = "STAGEWISE_BENCH_TINY"
"""Set to 1, it has every suite (and ``stagewise plan validate``) run as with ``--tiny``."""


def tiny_from_environment(log=None) -> bool:
    """Whether ``STAGEWISE_BENCH_TINY=1`` asks for toy sizes (said on ``log`` when it does)."""
    value = os.environ.get(TINY_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{TINY_ENV} must be 1 (toy sizes) or 0, got {value!r}")
    if value == "1" and log is not None:
        log(f"{TINY_ENV}=1: toy sizes and the fewest repeats, as with --tiny; the numbers mean nothing")
    return value == "1"


def add_common(parser: argparse.ArgumentParser, results: str, *, device: bool = False, quick: bool = False) -> None:
    """The shared options of a suite whose results files are ``<device>-<results>.*``."""
    if device:
        parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                            help="default: cuda if available, else cpu")
    if quick:
        parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--tiny", action="store_true",
                        help=f"toy sizes and the fewest repeats, to check that the suite works (the timings mean "
                             f"nothing; {TINY_ENV}=1 does the same)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"directory for the results, <device>-{results}.* (default: a new folder "
                             "bench/results/<device>-<date>, never the committed results, and ignored by git; "
                             "<device> names the CPU model and the ISA level the kernels ran at)")

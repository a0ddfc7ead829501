"""``stagewise bench SUITE ...``: the microbenchmarks against their baselines, a subcommand per suite
with its own options (:mod:`stagewise.bench.cli`), imported only when asked for (the benchmarks
import torch)."""

from __future__ import annotations


def run(argv: list[str]) -> int:
    from stagewise.bench.cli import main

    return main(argv)

"""``stagewise bench kernels``: each op (``stagewise.ops``) against its baselines — the pure-torch
reference, torch.compile of it, FlashInfer when available, and for attention SDPA and FlexAttention
over the same paged cache (:mod:`~stagewise.bench.kernels.attention_baselines`) — validated once,
then timed, as GB/s and % of the copy and read bandwidth measured in the same run
(:mod:`~stagewise.bench.kernels.runner`). The cases (:mod:`~stagewise.bench.kernels.cases`) count
their bytes from the shapes; the table is :mod:`~stagewise.bench.kernels.report`'s."""

from __future__ import annotations

import argparse

from stagewise.bench.kernels.cases import OPS
from stagewise.bench.options import add_common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "kernels", device=True, quick=True)
    parser.add_argument("--ops", default=None, help=f"comma-separated subset of: {','.join(OPS)} (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline (FlexAttention still compiles)")
    parser.add_argument("--repeats", type=int, default=None, help="most timed calls per measurement")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls before timing")


def run(args: argparse.Namespace, log) -> int:
    from stagewise.bench.kernels import runner

    return runner.run(args, log)

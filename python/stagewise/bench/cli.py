"""``stagewise bench SUITE ...``: a subcommand per suite, each with its own options and help.

A suite is a module with ``add_arguments(parser)`` and ``run(args, log) -> int``; adding one is a
line of :data:`SUITES`. Before a suite runs, :func:`main` applies what every suite shares
(:mod:`stagewise.bench.options`): ``--tiny`` or ``STAGEWISE_BENCH_TINY=1``, ``--threads``, and an
``--out`` folder of its own when none is given.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUITES = {
    "kernels": ("stagewise.bench.kernels", "each op against its baselines (pure torch, torch.compile, FlashInfer)"),
    "e2e": ("stagewise.bench.e2e", "whole-model generation: against transformers and llama.cpp, by stage count, "
                                   "TP size, launcher, and through a stage's failure"),
    "transport": ("stagewise.bench.transport", "one-way latency and GB/s of each transport, 8 KB - 64 MB frames"),
    "shm": ("stagewise.bench.transport.shm", "the shared-memory ring against loopback sockets"),
    "profile": ("stagewise.bench.profile", "this machine as a planner device profile (JSON)"),
    "serve": ("stagewise.bench.serve", "stagewise serve against llama.cpp's OpenAI server under load"),
    "kv": ("stagewise.bench.kv", "the compact KV cache (int8, fp8): bytes, decode speed beside llama.cpp's q8_0 "
                                 "cache, and its error"),
    "structured": ("stagewise.bench.structured", "structured output: the grammar engines, and the mask's share of "
                                                 "decode time"),
}  # fmt: skip
"""Suite name -> (its module, what it measures)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagewise bench", description="Microbenchmarks, each against its baselines, "
                                "into JSON + Markdown under bench/results/.")
    sub = p.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, (module, what) in SUITES.items():
        suite = importlib.import_module(module)
        sp = sub.add_parser(name, help=what, description=f"stagewise bench {name}: {what}.")
        suite.add_arguments(sp)
        sp.set_defaults(run=suite.run)
    return p


def main(argv: list[str]) -> int:
    """Run the suite ``argv`` names (``argv``: what follows ``stagewise bench``); the exit status."""
    from stagewise.bench.options import tiny_from_environment

    args = parser().parse_args(argv)
    log = (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        args.tiny = args.tiny or tiny_from_environment(log)
    except ValueError as e:
        print(f"stagewise bench: {e}", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"stagewise bench: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    import torch

    from stagewise.bench import report

    # Refused before anything is named after the device (the results folder) or run on it.
    if getattr(args, "device", None) == "cuda" and not torch.cuda.is_available():
        print(f"stagewise bench: --device cuda was asked for, but torch {torch.__version__} sees no CUDA device",
              file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.out is None:  # never over the committed results unless --out says so
        device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        args.out = report.default_out(report.device_slug(device))
    return args.run(args, log=log)

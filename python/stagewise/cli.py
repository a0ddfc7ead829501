"""The `stagewise` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stagewise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="microbenchmarks against their baselines")
    from stagewise.bench import add_arguments

    add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "bench":
        from stagewise.bench import run

        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

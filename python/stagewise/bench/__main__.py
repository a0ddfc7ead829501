"""``python -m stagewise.bench kernels``: the same as ``stagewise bench kernels``."""

from __future__ import annotations

import argparse
import sys

from stagewise.bench import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stagewise.bench", description="microbenchmarks against their baselines"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

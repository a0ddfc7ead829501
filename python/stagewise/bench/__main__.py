"""``python -m stagewise.bench SUITE ...``: the same as ``stagewise bench SUITE ...``."""

import sys

from stagewise.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

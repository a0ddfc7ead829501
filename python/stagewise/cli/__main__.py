"""``python -m stagewise.cli``: the ``stagewise`` command, for a host without the console script."""

import sys

from stagewise.cli import _main

sys.exit(_main())

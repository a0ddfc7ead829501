"""``stagewise stage``: one pipeline stage of a run plan, as a process (see
:mod:`stagewise.pipeline.process`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from stagewise import startup_gc
from stagewise.launch.stage_args import add_arguments, prepare

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    startup_gc.pause()  # until the stage's model is built (StageProcess.run settles it)
    if args.die_with_parent:
        _die_with_parent()
    # Until the stage exists there is nothing to clean up: a SIGTERM (the launcher stopping a run
    # that is still starting) ends the process at once, rather than raising inside an import.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    code = 1
    try:
        from stagewise.pipeline import process

        del process  # imported (torch too) before SIGTERM unwinds

        # From here SIGTERM unwinds, so that the stage closes its links and rings on the way out.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        serve_stage, _ = prepare(args)
        code = serve_stage()
    except KeyboardInterrupt:
        code = 130
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except Exception as err:  # noqa: BLE001 - one line for the operator, not a traceback
        import json
        import socket

        from stagewise.pipeline.lines import FAILED_LINE  # nothing heavy: the import that failed may be torch's

        which = args.stage if args.stage is not None else os.environ.get("RANK", "?")
        message = f"{type(err).__name__}: {err}"
        print(f"stagewise stage {which}: {message}", file=sys.stderr, flush=True)
        # For the launcher, which reads this process's output (also through ssh).
        print(f"{FAILED_LINE} {json.dumps({'stage': which, 'host': socket.gethostname(), 'error': message})}",
              flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: the heartbeat and accept threads may still be blocked in I/O.
    os._exit(code)


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the process that started it exits (no orphans)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

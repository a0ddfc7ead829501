"""``stagewise stage``: one pipeline stage of a run plan, as a process (see
:mod:`stagewise.pipeline.process`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from stagewise import heap


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--plan", help="run plan (YAML/JSON) naming every stage")
    source.add_argument("--plan-json", metavar="JSON", help="the run plan itself, as JSON (what 'stagewise launch' "
                        "prints, so that no file needs copying)")
    parser.add_argument("--stage", type=int, default=None, help="this process's stage index")
    parser.add_argument("--rank", type=int, default=0,
                        help="this process's rank in its stage (0, the leader, unless the stage has tp * pcp ranks)")
    parser.add_argument("--torchrun", action="store_true",
                        help="under torchrun: the stage index is RANK, and the listen address is published in "
                             "torch.distributed's store at MASTER_ADDR:MASTER_PORT")
    parser.add_argument("--listen", default=None, help="HOST:PORT to listen on (default: the plan's)")
    parser.add_argument("--auth-token", default=None,
                        help="shared secret for the hello (default: $STAGEWISE_AUTH_TOKEN)")
    parser.add_argument("--rejoin", type=float, default=0.0, metavar="SECONDS",
                        help="when the pipeline breaks (a neighbour or the driver lost), keep the layers loaded, "
                             "drop every request's KV and wait this long for a driver to connect again, instead "
                             "of exiting (runs of one rank per stage; default 0: exit)")
    parser.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true",
                        help="instead of the stage, the preflight probe `stagewise doctor` talks to (binds the "
                             "stage's address, reads no weights)")


def main(args: argparse.Namespace) -> int:
    heap.pause()  # until the stage's model is built (StageProcess.run settles it): see stagewise.heap
    if args.die_with_parent:
        _die_with_parent()
    # Until the stage exists there is nothing to clean up: a SIGTERM (the launcher stopping a run
    # that is still starting) ends the process at once, rather than raising inside an import.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    token = args.auth_token or os.environ.get("STAGEWISE_AUTH_TOKEN") or None
    code = 1
    try:
        from stagewise.launch.multihost import stage_from_args
        from stagewise.pipeline.process import StageProcess

        # From here SIGTERM unwinds, so that the stage closes its links and rings on the way out.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        plan, index, rank, on_listening = stage_from_args(args)
        if args.probe:
            from stagewise.launch.probe import serve_probe

            heap.settle()  # nothing loads
            code = serve_probe(plan, index, rank, args.listen, token=token)
        else:
            if args.rejoin < 0:
                raise ValueError(f"--rejoin must be >= 0 seconds, got {args.rejoin}")
            stage = StageProcess(plan, index, rank=rank, listen=args.listen, auth_token=token, rejoin_s=args.rejoin)
            stage.on_listening = on_listening
            code = stage.run()
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

"""The lines a stage process prints on its standard output for whoever started it (a launcher
reads them, also through ssh): ``STAGEWISE-LISTENING host port`` once it listens, and
``STAGEWISE-FAILED {json}`` with its own words when it fails; and on its standard error, the
lines of its log, each with the time in front as a server's log has it. A module of its own,
importing nothing heavy, so that a stage failing while it still imports torch can say so."""

import sys
import time

READY_LINE = "STAGEWISE-LISTENING"
FAILED_LINE = "STAGEWISE-FAILED"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
"""The time at the start of a log line (``time.strftime``'s format), milliseconds after it: a stage's
lines and ``stagewise serve``'s log read alike, ``2026-11-28 12:43:16.762 ...``."""


def log_line(text: str) -> None:
    """``text`` on standard error, for a person reading the log, the time in front."""
    now = time.time()
    print(f"{time.strftime(TIME_FORMAT, time.localtime(now))}.{int(now * 1000) % 1000:03d} {text}",
          file=sys.stderr, flush=True)


def print_listening(host: str, port: int) -> None:
    """Tell whoever started this process where it listens (its ``READY_LINE``)."""
    print(f"{READY_LINE} {host} {port}", flush=True)

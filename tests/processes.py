"""Whether the processes a test started are still there (a zombie its parent has not reaped
counts as gone)."""

from __future__ import annotations

import time


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def gone(pids, timeout: float = 10.0) -> bool:
    """Whether every one of ``pids`` is gone within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False

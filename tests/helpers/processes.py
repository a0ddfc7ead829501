"""Whether the processes a test started are still there (a zombie its parent has not reaped
counts as gone), and which processes a process started."""

from __future__ import annotations

import os
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


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def ended_by_ctrl_c(proc, timeout: float) -> str:
    """Wait up to ``timeout`` for ``proc``, which got a Ctrl-C (its process group killed if it
    outlives that), check that it ended as a Ctrl-C should (exit 130, no traceback), and return
    its standard error."""
    import signal
    import subprocess

    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = proc.stderr.read()
    assert code == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    return err

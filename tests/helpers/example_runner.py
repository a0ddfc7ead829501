"""Runs one documentation example in a scratch folder and says where it failed.

A shell block runs as one bash script (so ``&``, ``cd`` and variables work as a reader expects),
stopped by the first failing command; a trap reports that command and its line, which
:func:`failure` maps back to the page. A Python block runs with the interpreter of the tests,
compiled under the page's name with its lines where the page has them, so a traceback names
``README.md``, line N. The process group is killed on a timeout, background stages included.

Some examples listen on fixed ports (``examples/plan.yaml``'s stages, torchrun's store), so one
example runs at a time on a machine, whichever checkout's tests run it: a lock file in the
system's temporary folder serialises them.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from helpers.doc_examples import SHELLS, Example

# One line, so that the block's line k is the script's line k + 1. On exit, background jobs the
# block started (stages) are stopped.
_BASH_PREAMBLE = ("set -eo pipefail; "
                  "trap 'rc=$?; echo \"example-failed line=$LINENO exit=$rc: $BASH_COMMAND\" >&2' ERR; "
                  "trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT\n")
_FAILED = re.compile(r"example-failed line=(?P<line>\d+) exit=(?P<rc>\d+): (?P<command>.*)")
# Compiles the page's code padded with the lines above it: tracebacks then give page lines.
_PYTHON_RUNNER = ("import sys; doc, line, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]; "
                  "sys.argv = [doc]; src = '\\n' * line + open(path, encoding='utf-8').read(); "
                  "exec(compile(src, doc, 'exec'), {'__name__': '__main__'})")
TAIL_LINES = 40
LOCK = Path(tempfile.gettempdir()) / "stagewise-doc-examples.lock"


@dataclass(frozen=True, slots=True)
class Outcome:
    returncode: int
    output: str
    timed_out: bool = False


def run(example: Example, scratch: Path, env: dict[str, str], timeout_s: float) -> Outcome:
    script_dir = scratch / ".examples"
    script_dir.mkdir(exist_ok=True)
    stem = f"{example.doc.replace('/', '_')}-{example.line}"
    if example.language in SHELLS:
        path = script_dir / f"{stem}.sh"
        path.write_text(_BASH_PREAMBLE + example.code, encoding="utf-8")
        argv = ["bash", str(path)]
    else:
        path = script_dir / f"{stem}.py"
        path.write_text(example.code, encoding="utf-8")
        argv = [sys.executable, "-c", _PYTHON_RUNNER, example.doc, str(example.line), str(path)]
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        proc = subprocess.Popen(argv, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            return Outcome(proc.returncode, out)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return Outcome(proc.returncode, out, timed_out=True)


def failure(example: Example, outcome: Outcome, timeout_s: float) -> str | None:
    """What went wrong, naming the page, the line and the command; None when the example worked.
    An exit status of 0 with a Python traceback in the output is a failure too."""
    traceback = "Traceback (most recent call last)" in outcome.output
    if outcome.returncode == 0 and not outcome.timed_out and not traceback:
        return None
    where, what = example.where, f"the {example.language} block"
    if m := _FAILED.search(outcome.output):
        where = f"{example.doc}:{example.doc_line(int(m['line']) - 1)}"
        what = f"`{m['command']}`"
    if outcome.timed_out:
        what += f" did not finish within {timeout_s:.0f} s"
    elif outcome.returncode != 0:
        what += f" failed (exit status {outcome.returncode})"
    else:
        what += " printed a traceback"
    tail = outcome.output.splitlines()[-TAIL_LINES:]
    return f"{where}: {what}\n--- output (last {len(tail)} lines) ---\n" + "\n".join(tail)

"""Local launch: the stage processes of a plan on this machine, torn down with the driver.

The plan travels on each stage's command line (``--plan-json``): a launch writes no file. A
stage prints ``STAGEWISE-LISTENING host port`` once it listens; :func:`read_address` waits for
that line, which also comes through ssh.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence

from stagewise.parallel.runplan import RunPlan
from stagewise.pipeline.process import FAILED_LINE, READY_LINE


class StageProcesses:
    """The processes of a plan's stages (local children or ssh clients), one per stage."""

    def __init__(self, procs: Sequence[subprocess.Popen]) -> None:
        self.procs = list(procs)

    def __len__(self) -> int:
        return len(self.procs)

    def exit_code(self, stage: int) -> int | None:
        return self.procs[stage].poll()

    def failure(self, stage: int) -> str | None:
        """The ``STAGEWISE-FAILED`` words of an exited stage (what it printed after listening)."""
        proc = self.procs[stage]
        if proc.poll() is None or proc.stdout is None or proc.stdout.closed:
            return None
        for line in proc.stdout.read().splitlines():
            if line.startswith(FAILED_LINE):
                return failure_message(stage, line)
        return None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, grace_s: float = 5.0, term_s: float | None = None) -> None:
        """Wait up to ``grace_s`` for each to exit, then SIGTERM, then after ``term_s`` (default
        2 s, or ``grace_s`` when shorter) SIGKILL: no orphans."""
        term_s = min(2.0, grace_s) if term_s is None else term_s
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        deadline = time.monotonic() + term_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    stream.close()


def stage_argv(plan: RunPlan, index: int, *, program: Sequence[str] = (sys.executable, "-m", "stagewise.cli"),
               remote_plan: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The argv that runs stage ``index`` of ``plan`` (the plan inline unless ``remote_plan``
    names a plan file on the stage's host)."""
    source = ["--plan", remote_plan] if remote_plan else ["--plan-json", plan.to_json()]
    return [*program, "stage", *source, "--stage", str(index), *extra]


def spawn_stages(plan: RunPlan, *, auth_token: str | None = None,
                 timeout_s: float = 120.0) -> tuple[StageProcesses, list[tuple[str, int]]]:
    """Start every stage of ``plan`` here and wait until each listens. Returns the processes and
    their listen addresses; on any error every process started is stopped."""
    env = dict(os.environ)
    if auth_token:
        env["STAGEWISE_AUTH_TOKEN"] = auth_token
    procs = StageProcesses([])
    try:
        for spec in plan.stages:
            stage_env = dict(env)
            if spec.threads:
                stage_env["OMP_NUM_THREADS"] = str(spec.threads)
            procs.procs.append(subprocess.Popen(stage_argv(plan, spec.index, extra=["--die-with-parent"]),
                                                env=stage_env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                                text=True,
                                                # A terminal's Ctrl-C goes to the driver alone, which then stops
                                                # the stages; a stage still importing would otherwise die with a
                                                # traceback.
                                                start_new_session=True))
        addresses = [read_address(p, i, timeout_s) for i, p in enumerate(procs.procs)]
    except BaseException:
        procs.stop(grace_s=0.5)
        raise
    return procs, addresses


def read_address(proc: subprocess.Popen, index: int, timeout_s: float) -> tuple[str, int]:
    """The address stage ``index`` printed once it listens; RuntimeError with the stage's own
    words when it failed before."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            parts = line.split()
            if len(parts) == 3 and parts[0] == READY_LINE:
                return parts[1], int(parts[2])
            if parts and parts[0] == FAILED_LINE:
                raise RuntimeError(failure_message(index, line))
        elif proc.poll() is not None:
            break
    code = proc.poll()
    if code is not None:
        raise RuntimeError(f"stage {index} exited with code {code} before listening (see its error above)")
    raise TimeoutError(f"stage {index} did not start listening within {timeout_s:.0f} s")


def failure_message(index: int, line: str) -> str:
    """``stage I on HOST failed: ERROR`` from a stage's ``STAGEWISE-FAILED {json}`` line."""
    import json

    try:
        info = json.loads(line.split(None, 1)[1])
        return f"stage {index} on {info['host']} failed: {info['error']}"
    except (IndexError, ValueError, KeyError, TypeError):
        return f"stage {index} failed: {line.strip()}"

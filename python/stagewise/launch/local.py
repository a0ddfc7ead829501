"""Local launch: the stage processes of a plan on this machine, torn down with the driver."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stagewise.launch.planfile import RunPlan
from stagewise.runtime.stage_process import READY_LINE


def stage_command(plan_path: str | Path, index: int, *, python: str = sys.executable) -> list[str]:
    return [python, "-m", "stagewise.cli", "stage", "--plan", str(plan_path), "--stage", str(index)]


def spawn_stages(plan: RunPlan, *, auth_token: str | None = None, workdir: str | None = None,
                 timeout_s: float = 120.0, threads: list[int | None] | None = None
                 ) -> tuple[list[subprocess.Popen], list[tuple[str, int]], Path]:
    """Start every stage of ``plan`` here and wait until each listens. Returns the processes,
    their listen addresses and the plan file they read."""
    folder = Path(workdir or tempfile.mkdtemp(prefix="stagewise-"))
    path = plan.dump(folder / "plan.json")
    env = dict(os.environ)
    if auth_token:
        env["STAGEWISE_AUTH_TOKEN"] = auth_token
    procs: list[subprocess.Popen] = []
    try:
        for spec in plan.stages:
            stage_env = dict(env)
            if spec.threads:
                stage_env["OMP_NUM_THREADS"] = str(spec.threads)
            procs.append(subprocess.Popen(stage_command(path, spec.index) + ["--die-with-parent"], env=stage_env,
                                          stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                          # A terminal's Ctrl-C goes to the driver alone, which then stops the
                                          # stages; a stage still importing would otherwise die with a traceback.
                                          start_new_session=True))
        addresses = [_read_address(p, i, timeout_s) for i, p in enumerate(procs)]
    except BaseException:
        stop_processes(procs, grace_s=0.5)
        raise
    return procs, addresses, path


def _read_address(proc: subprocess.Popen, index: int, timeout_s: float) -> tuple[str, int]:
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
        elif proc.poll() is not None:
            break
    code = proc.poll()
    if code is not None:
        raise RuntimeError(f"stage {index} exited with code {code} before listening (see its error above)")
    raise TimeoutError(f"stage {index} did not start listening within {timeout_s:.0f} s")


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 5.0, term_s: float | None = None) -> None:
    """Wait up to ``grace_s`` for each to exit, then SIGTERM, then after ``term_s`` (default 2 s,
    or ``grace_s`` when shorter) SIGKILL: no orphans."""
    term_s = min(2.0, grace_s) if term_s is None else term_s
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    deadline = time.monotonic() + term_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()

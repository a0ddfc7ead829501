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
from stagewise.pipeline.lines import FAILED_LINE, READY_LINE


class StageProcesses:
    """The processes of a plan's stages (local children or ssh clients), one per rank of each
    stage, in the plan's rank order (:attr:`RunPlan.members`); None in the place of a rank that
    another host runs (started there by hand, :mod:`stagewise.launch.here`), which is watched by
    its links and heartbeats alone."""

    def __init__(self, procs: Sequence[subprocess.Popen | None], labels: Sequence[str] | None = None,
                 spawn=None) -> None:
        self.procs = list(procs)
        self.labels = list(labels) if labels is not None else [f"stage {i}" for i in range(len(self.procs))]
        self.spawn = spawn
        """How :meth:`respawn` starts ranks: ``spawn(plan, auth_token=, extra=, members=)`` returning
        (processes, addresses) as :func:`spawn_stages` (the default: here) or ``ssh_spawn`` do."""

    def __len__(self) -> int:
        return len(self.procs)

    def exit_code(self, stage: int) -> int | None:
        proc = self.procs[stage]
        return None if proc is None else proc.poll()

    def failure(self, stage: int) -> str | None:
        """The ``STAGEWISE-FAILED`` words of an exited stage (what it printed after listening)."""
        proc = self.procs[stage]
        if proc is None or proc.poll() is None or proc.stdout is None or proc.stdout.closed:
            return None
        for line in proc.stdout.read().splitlines():
            if line.startswith(FAILED_LINE):
                return failure_message(self.labels[stage], line)
        return None

    @property
    def pids(self) -> list[int | None]:
        return [None if p is None else p.pid for p in self.procs]

    def respawn(self, plan: RunPlan, which: Sequence[int], *, auth_token: str | None,
                extra: Sequence[str] = ()) -> tuple[RunPlan, list]:
        """Processes ``which`` (indices of :attr:`RunPlan.members`; killed first if they still
        run) started again the way they were (here, or on their hosts over ssh). Returns the plan
        and their listen addresses."""
        which = list(which)
        StageProcesses([self.procs[i] for i in which]).stop(grace_s=0.0, term_s=0.0)
        new, addresses = (self.spawn or spawn_stages)(plan, auth_token=auth_token, extra=extra,
                                                      members=[plan.members[i] for i in which])
        for i, proc in zip(which, new.procs, strict=True):
            self.procs[i] = proc
        return plan, addresses

    def stop(self, grace_s: float = 5.0, term_s: float | None = None) -> None:
        """Wait up to ``grace_s`` for each to exit, then SIGTERM, then after ``term_s`` (default
        2 s, or ``grace_s`` when shorter) SIGKILL: no orphans."""
        term_s = min(2.0, grace_s) if term_s is None else term_s
        deadline = time.monotonic() + grace_s
        procs = [p for p in self.procs if p is not None]
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
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    stream.close()


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or ``taskset`` may
    narrow; the machine's count where the platform has no affinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def local_plan(model: str, config, stages: int, device_type: str, dtype: str, *, tp: int = 1, pcp: int = 1,
               partition="even", transport: str = "auto", checksum: bool = True, auth_token: str | None = None,
               threads: int | None = None, **limits) -> RunPlan:
    """A plan of ``stages`` stages of ``pcp * tp`` processes each, on this machine (``auth_token``
    is the caller's to pass to :func:`spawn_stages`; threads default to the cores shared out)."""
    import dataclasses

    from stagewise.parallel.plan import decode_layer_costs

    per_stage = tp * pcp
    if device_type == "cuda":  # a driver with no GPU of its own (a Ray cluster's head): cuda:0, placed anew there
        import torch

        devices = [f"cuda:{i * per_stage % max(1, torch.cuda.device_count())}" for i in range(stages)]
    else:
        devices = ["cpu"] * stages
    threads = threads or max(1, usable_cores() // (stages * per_stage))
    measured = partition == "measured"  # split after the nodes are measured (launch.measured)
    partition = "even" if measured else partition
    plan = RunPlan.build(model, config.num_layers, stages, partition,
                         costs=decode_layer_costs(config) if partition == "balanced" else None, devices=devices,
                         tp=tp, pcp=pcp, dtype=dtype, transport=transport, checksum=checksum, **limits)
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, threads=threads) for s in plan.stages),
                               partition="measured" if measured else plan.partition)


def stage_argv(plan: RunPlan, index: int, *, rank: int = 0,
               program: Sequence[str] = (sys.executable, "-m", "stagewise.cli"), remote_plan: str | None = None,
               extra: Sequence[str] = ()) -> list[str]:
    """The argv that runs rank ``rank`` of stage ``index`` of ``plan`` (the plan inline unless
    ``remote_plan`` names a plan file on the stage's host)."""
    source = ["--plan", remote_plan] if remote_plan else ["--plan-json", plan.to_json()]
    return [*program, "stage", *source, "--stage", str(index), *(["--rank", str(rank)] if rank else []), *extra]



def spawn_stages(plan: RunPlan, *, auth_token: str | None = None, timeout_s: float = 120.0,
                 extra: Sequence[str] = (), keep_going: bool = False,
                 members: Sequence[tuple[int, int]] | None = None) -> tuple[StageProcesses, list]:
    """Start every rank of every stage of ``plan`` here (or only ``members``, (stage, rank) pairs;
    ``extra``: more arguments of each) and wait until each listens. Returns the processes and
    their listen addresses (in :attr:`RunPlan.members` order); on any error every process started
    is stopped, or with ``keep_going`` the error takes that rank's place in the list (a string)."""
    env = dict(os.environ)
    if auth_token:
        env["STAGEWISE_AUTH_TOKEN"] = auth_token
    members = plan.members if members is None else list(members)
    procs = StageProcesses([], [plan.member_label(s, r) for s, r in members])
    try:
        for index, rank in members:
            spec = plan.stages[index]
            stage_env = dict(env)
            if spec.threads:
                stage_env["OMP_NUM_THREADS"] = str(spec.threads)
            argv = stage_argv(plan, index, rank=rank, extra=["--die-with-parent", *extra])
            procs.procs.append(subprocess.Popen(argv,
                                                env=stage_env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                                text=True,
                                                # A terminal's Ctrl-C goes to the driver alone, which then stops
                                                # the stages; a stage still importing would otherwise die with a
                                                # traceback.
                                                start_new_session=True))
        addresses = read_addresses(procs.procs, procs.labels, timeout_s, keep_going)
    except BaseException:
        procs.stop(grace_s=0.5)
        raise
    return procs, addresses


def read_addresses(procs, labels, timeout_s: float, keep_going: bool = False) -> list:
    """Each process's listen address (:func:`read_address`); with ``keep_going`` a failure's words
    take its place instead of raising."""
    out = []
    for proc, label in zip(procs, labels):
        try:
            out.append(read_address(proc, label, timeout_s))
        except (RuntimeError, TimeoutError) as err:
            if not keep_going:
                raise
            out.append(str(err))
    return out


def read_address(proc: subprocess.Popen, index: int | str, timeout_s: float) -> tuple[str, int]:
    """The address a stage process (``index``: its stage index, or its label such as
    ``stage 1 rank 2``) printed once it listens; RuntimeError with its own words when it failed
    before."""
    label = index if isinstance(index, str) else f"stage {index}"
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
                raise RuntimeError(failure_message(label, line))
        elif proc.poll() is not None:
            break
    code = proc.poll()
    if code is not None:
        raise RuntimeError(f"{label} exited with code {code} before listening (see its error above)")
    raise TimeoutError(f"{label} did not start listening within {timeout_s:.0f} s")


def failure_message(index: int | str, line: str) -> str:
    """``stage I on HOST failed: ERROR`` (``stage I rank R ...``) from a process's
    ``STAGEWISE-FAILED {json}`` line; ``index`` is the stage index or the process's label."""
    import json

    label = index if isinstance(index, str) else f"stage {index}"
    try:
        info = json.loads(line.split(None, 1)[1])
        return f"{label} on {info['host']} failed: {info['error']}"
    except (IndexError, ValueError, KeyError, TypeError):
        return f"{label} failed: {line.strip()}"

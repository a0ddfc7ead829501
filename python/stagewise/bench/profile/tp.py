"""The TP link of this host, for the planner's CPU model (part of `stagewise bench profile`): the
all-reduces and all-gathers of a stage's TP group of two CPU rank processes, joined as the stage
processes join theirs (:func:`measure_tp_link`), fitted to the planner's ring formulas
(:func:`fit_tp_link`)."""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch


TP_LINK_SIZES = (2304, 8 << 10, 64 << 10, 256 << 10, 1 << 20)
"""Bytes of the float32 tensor each rank hands to a collective: a SmolLM2-sized decode row (the
all-reduce of one token's hidden state), then 8 KiB to 1 MiB."""

def _tp_peer(rank: int, store: tuple[str, int], sizes: tuple[int, ...], calls: int, conn) -> None:
    """One rank: ``calls`` timed all-reduces and all-gathers per size, in lockstep with the other,
    each after a few linears (untimed, :class:`~stagewise.bench.profile.runtime.StepWork`), as a
    stage's collectives come between a layer's kernels; sizes and collectives take turns in rounds
    of a few calls, so that a burst of other work on a shared machine spoils a few calls of each,
    not one size's figure."""
    import warnings

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's note on all_gather_into_tensor
    from stagewise.bench.profile.runtime import StepWork
    from stagewise.parallel import comm
    from stagewise.parallel.groups import join_stage_groups
    from stagewise.parallel.runplan import RunPlan

    # The groups of one stage of 2 CPU ranks, joined as the stage processes join theirs: whatever
    # the runtime runs a stage's collectives over on this host is what is timed.
    plan = RunPlan.build("bench/profile", 1, 1, tp=2)
    group = join_stage_groups(plan, 0, rank, store, [], timeout_s=60.0).tp
    try:
        tensors = {n: torch.randn(n // 4) for n in sizes}
        fns = {"all_reduce": group.all_reduce, "all_gather": group.all_gather}
        times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in fns}
        per_round = 5
        work = StepWork(seed=rank)
        for r in range(1 + -(-calls // per_round)):  # round 0 warms up
            for n, t in tensors.items():
                for name, fn in fns.items():
                    for _ in range(per_round):
                        work()
                        t0 = time.perf_counter()
                        fn(t)
                        if r:
                            times[name][n].append(time.perf_counter() - t0)
        import torch.distributed as dist

        kind = "shared memory" if getattr(group, "shm", None) is not None else f"torch.distributed {dist.get_backend()}"
        conn.send({"group": kind,
                   **{name: {n: statistics.median(v) for n, v in by.items()} for name, by in times.items()}})
    finally:
        close = getattr(group, "close", None)
        if close is not None:
            close()
        comm.destroy_world()


def fit_tp_link(all_reduce: dict[int, float], all_gather: dict[int, float]) -> tuple[float, float]:
    """``(latency_s, bandwidth)`` of the link the planner's ring formulas need to give these times
    of 2 ranks (:func:`stagewise.planner.compute.op_time`: an all-reduce of ``B`` bytes
    ``2 * latency + B / bandwidth``, an all-gather into ``G`` bytes ``latency + G / 2 / bandwidth``):
    least squares over both collectives and every size, each time weighted by its inverse (the
    small, latency-bound sizes the decode sends count as much as the large ones)."""
    rows = [(2.0, float(b), t) for b, t in all_reduce.items()] + \
           [(1.0, 2.0 * b / 2, t) for b, t in all_gather.items()]  # gathered bytes 2 * b, over 2
    a11 = a12 = a22 = y1 = y2 = 0.0
    for c, x, t in rows:
        w = 1.0 / (t * t)
        a11 += w * c * c
        a12 += w * c * x
        a22 += w * x * x
        y1 += w * c * t
        y2 += w * x * t
    det = a11 * a22 - a12 * a12
    lat = (y1 * a22 - y2 * a12) / det
    inv_bw = (a11 * y2 - a12 * y1) / det
    if lat < 0 or inv_bw <= 0:  # noise at either end: fall back on the end points
        small, big = min(all_reduce), max(all_reduce)
        inv_bw = max((all_reduce[big] - all_reduce[small]) / (big - small), 1e-12)
        lat = max((all_reduce[small] - small * inv_bw) / 2, 0.0)
    return lat, 1.0 / inv_bw


def measure_tp_link(sizes: tuple[int, ...] = TP_LINK_SIZES, calls: int = 50, log=print) -> dict:
    """The TP link of this host: 2 spawned processes, one torch thread each, join the groups of one
    stage of 2 CPU ranks through a TCPStore (:func:`stagewise.parallel.comm.host_store`,
    :func:`stagewise.parallel.groups.join_stage_groups`, as a stage's ranks do: gloo, or whatever
    the runtime runs such a group's collectives over) and time the TP group's ``all_reduce`` and
    ``all_gather`` of float32 tensors of
    ``sizes`` bytes each (median of ``calls``, taken in rounds of 5 over every size after a warm-up
    round, each call after a few linears as in a step; rank 0's clock);
    :func:`fit_tp_link` turns them into the link's latency and bandwidth."""
    from stagewise.parallel import comm

    store, address = comm.host_store("127.0.0.1", timeout_s=60.0)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_tp_peer, args=(r, address, tuple(sizes), calls, child), daemon=True)
             for r, (_, child) in enumerate(pipes)]
    for p in procs:
        p.start()
    try:
        got = pipes[0][0].recv() if pipes[0][0].poll(120) else None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
    if got is None:
        raise OSError("bench profile: the TP link ranks reported nothing")
    lat, bw = fit_tp_link(got["all_reduce"], got["all_gather"])
    log(f"  TP link ({got['group']}, 2 processes): latency {lat * 1e6:.1f} us, bandwidth {bw / 1e9:.2f} GB/s; "
        + ", ".join(f"{n >> 10 if n >= 1024 else n}{'K' if n >= 1024 else 'B'}: all-reduce "
                    f"{got['all_reduce'][n] * 1e6:.0f} us" for n in sizes))
    return {"latency_s": lat, "bandwidth": bw,
            "all_reduce_s": {str(n): v for n, v in got["all_reduce"].items()},
            "all_gather_s": {str(n): v for n, v in got["all_gather"].items()}, "calls": calls,
            "group": got["group"],
            "what": "all_reduce / all_gather of a stage's TP group of 2 CPU ranks (joined as the stage processes join "
                    "theirs) on float32 tensors, one torch thread a process, each call after 3 Q4_1 576x1536 linears "
                    "as in a decode step; fitted to the planner's ring formulas"}

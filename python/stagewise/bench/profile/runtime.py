"""The runtime's own costs that only the full device profile measures (part of `stagewise bench
profile`; the primitives a node profile measures too are :mod:`stagewise.measure.primitives`).
Each is measured apart from any end-to-end run (the planner's validation compares against those;
nothing here looks at them):

- the pipeline's links are measured apart, as a stage's step crosses them
  (:mod:`stagewise.bench.profile.hop`);
- the TP link is measured apart (:mod:`stagewise.bench.profile.tp`).
- ``concurrency``: seconds of one pass of the Q4_1 decode over 64 MiB of weights (beyond the
  caches) at the pace 1, 2, ... single-thread processes keep when they run it at once (spawned,
  started together; n over their summed passes per second): the ratio to one process is how much
  busy stage processes slow each other (cores, shared caches and memory, and other work on the
  machine).
- ``background_load``: runnable threads of other work on the machine while it is measured
  (``procs_running`` of /proc/stat, sampled for a second), recorded beside the results as a
  condition of the run (the planner does not model other work).
- :class:`StepWork`: the work of a decode step between its small operations, for timing those as
  a step runs them.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch

from stagewise.measure.primitives import QUANT_SHAPE, random_blocks



class StepWork:
    """The work a decode step does between two of its small operations, for timing those as a step
    runs them: ``linears`` Q4_1 linears of SmolLM2's MLP width (576 -> 1536) per call, their
    weights taking turns from a set larger than a core's caches (6.9 MB). Back to back in a tight
    loop, a collective or a few small tensor ops find their code and data hot and their peer in
    step; inside a decode step they find neither (on the 2-core machine of the results: a small
    all-reduce over shared memory 8-10 us in a tight loop, 20-30 us in a step)."""

    def __init__(self, linears: int = 3, seed: int = 0) -> None:
        from stagewise import ops

        self.linears, self._qtype, self._k = linears, ops.QTYPES["Q4_1"], 0
        gen = torch.Generator().manual_seed(seed)
        self._weights = [random_blocks(1536, 576, self._qtype, gen) for _ in range(12)]
        self._x = torch.randn(1, 576, generator=gen)

    def __call__(self) -> None:
        from stagewise import ops

        for _ in range(self.linears):
            ops.quant_linear(self._x, self._weights[self._k % len(self._weights)], self._qtype)
            self._k += 1


# ---- concurrency: how fast n single-thread workers run side by side --------------------------

CONCURRENCY_BYTES = 64 << 20


def _worker(n_bytes: int, seconds: float, start, conn) -> None:
    torch.set_num_threads(1)
    from stagewise import ops

    q = ops.QTYPES["Q4_1"]
    out_f, in_f = QUANT_SHAPE
    mats = [random_blocks(out_f, in_f, q) for _ in range(max(1, n_bytes // (out_f * in_f * 20 // 32)))]
    x = torch.randn(1, in_f)
    ops.quant_linear(x, mats[0], q)
    conn.send("ready")
    start.wait()
    passes, t0 = 0, time.perf_counter()
    t_end = t0 + seconds
    while time.perf_counter() < t_end or passes < 3:
        for m in mats:
            ops.quant_linear(x, m, q)
        passes += 1
    conn.send((passes, time.perf_counter() - t0))


def concurrent_pass_s(n: int, seconds: float = 1.0) -> float:
    """Seconds of one pass of the block-quantised decode over :data:`CONCURRENCY_BYTES` of weights
    at the pace ``n`` single-thread processes keep when they run it at once for ``seconds``:
    ``n / sum of their passes per second`` (their throughput shared out; with more processes than
    cores the scheduler may favour some, but a pipeline's stages block and wake every step and share
    the cores out over a step). With the same pass on its own it gives how much ``n`` busy stage
    processes slow each other, other work on the machine included."""
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    pipes = [ctx.Pipe() for _ in range(n)]
    procs = [ctx.Process(target=_worker, args=(CONCURRENCY_BYTES, seconds, start, child), daemon=True)
             for _, child in pipes]
    for p in procs:
        p.start()
    try:
        results = []
        for parent, _ in pipes:  # every worker has its weights before the common start
            if not parent.poll(120) or parent.recv() != "ready":
                raise OSError("bench profile: a concurrency worker did not start")
        start.set()
        for parent, _ in pipes:
            if not parent.poll(60 + seconds):
                raise OSError("bench profile: a concurrency worker reported nothing")
            results.append(parent.recv())
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return n / sum(passes / elapsed for passes, elapsed in results)


def concurrency(max_n: int, log=print) -> dict[str, float]:
    """``{"1": s, "2": s, ...}``: :func:`concurrent_pass_s` for 1 .. ``max_n`` processes."""
    out = {str(n): concurrent_pass_s(n) for n in range(1, max_n + 1)}
    log("  concurrency: " + ", ".join(f"{n} at once {v / out['1']:.2f}x" for n, v in out.items()))
    return out


# ---- other work on the machine ---------------------------------------------------------------

def background_load(seconds: float = 1.0, samples: int = 50) -> float:
    """Mean number of runnable threads of other work (``procs_running`` of /proc/stat, this
    sampler not counted) over ``seconds``; 0 where /proc/stat is not readable."""
    values = []
    for _ in range(samples):
        try:
            with open("/proc/stat") as f:
                line = next(x for x in f if x.startswith("procs_running"))
            values.append(max(int(line.split()[1]) - 1, 0))
        except (OSError, StopIteration, ValueError):
            return 0.0
        time.sleep(seconds / samples)
    return statistics.mean(values)

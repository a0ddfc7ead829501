"""The runtime's own primitive costs, measured for the planner's CPU model (part of `stagewise bench profile`).

Groups of figures, each measured apart from any end-to-end run (the planner's validation compares
against those; nothing here looks at them):

- ``quant``: :func:`stagewise.ops.quant_linear` per GGUF type, 96 MiB of distinct matrices a
  pass (so that the weights come from memory, not the caches), at 1, 2, 4 and ``ROWS`` rows of
  x. A few rows take the direct kernel, which decodes each block into registers and multiplies it
  into register tiles of a few rows of ``x``, so 2 rows cost about what 4 do; ``ROWS`` rows the
  tile kernel (dequantised panels, every row against them); two shapes of as many weights and 16 times
  the output rows apart split each row count's time into a cost per weight and per output row.
  Also ``s_per_weight`` (one row minus its FMAs) and ``flops_rate`` (slope from 1 to ``ROWS``
  rows) on 1024 x 1536 matrices. Each the median of passes spread over the measurement.
- ``attention_decode``: :func:`stagewise.ops.decode_attention` over paged caches streamed from
  memory (as a model's layers leave them), per call, per FLOP and per cached K/V byte.
- ``framework``: the Python + dispatcher cost the engine pays per decode step
  (:mod:`stagewise.bench.profile_framework`).
- ``links``: one-way latency and bandwidth of the real pipeline transports
  (``stagewise.transport`` tcp and shm channels, checksum on as the pipeline runs them) between
  two processes: frames of a float32 hidden tensor carry their send time (CLOCK_MONOTONIC,
  shared by the processes of a host), the receiver takes the difference after decoding; paced
  so that no frame queues. Latency = the small frame's time minus its bytes at the fitted
  bandwidth; bandwidth from the slope between the small and the large frame.
- the TP link is measured apart (:mod:`stagewise.bench.profile_tp`).
- ``concurrency``: seconds of one pass of the Q4_1 decode over 64 MiB of weights (beyond the
  caches) at the pace 1, 2, ... single-thread processes keep when they run it at once (spawned,
  started together; n over their summed passes per second): the ratio to one process is how much
  busy stage processes slow each other (cores, shared caches and memory, and other work on the
  machine).
- ``background_load``: runnable threads of other work on the machine while it is measured
  (``procs_running`` of /proc/stat, sampled for a second), recorded beside the results as a
  condition of the run (the planner does not model other work).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch


QUANT_SHAPE = (1024, 1536)  # out, in
QUANT_SHAPES_SPLIT = ((256, 6144), (4096, 384))
"""As many weights as :data:`QUANT_SHAPE` in 16 times the output rows between them: the pair gives
the kernel's cost per weight and per output row (its tiles' reductions and stores)."""
QUANT_STREAM_BYTES = 96 << 20
ROWS = 32
QUANT_ROWS = (1, 2, 4, ROWS)
QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
"""The GGUF types the planner models (its --weight-quant / --embed-quant choices)."""
"""Rows of x the block-quantised linear is timed with: the direct kernel runs register tiles of a
few rows against each decoded block, so its cost is not linear from one row to a few."""
LINK_SIZES = (2304, 1 << 20)  # bytes of the hidden tensor: a SmolLM2-sized decode row, and 1 MiB
LINK_FRAMES = 60


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


# ---- quant_linear --------------------------------------------------------------------------

def random_blocks(out: int, inp: int, qtype: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """Valid GGUF blocks ``[out, inp / block_weights * block_bytes]`` with random quants and small, normal scales."""
    from stagewise import ops

    nb, bb = inp // ops.QUANT_BLOCK_WEIGHTS[qtype], ops.QUANT_BLOCK_BYTES[qtype]
    data = torch.randint(0, 256, (out, nb, bb), dtype=torch.uint8, generator=gen)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    at = 208 if qtype == ops.QTYPES["Q6_K"] else 0  # where the fp16 d is
    data[..., at:at + 2] = scale
    if qtype == ops.QTYPES["Q4_K"]:  # Q4_K's 6-bit scales multiply d: a smaller d
        data[..., 0:2] = torch.tensor([0.0005], dtype=torch.float16).view(torch.uint8)
    if qtype in (ops.QTYPES["Q4_1"], ops.QTYPES["Q4_K"]):  # d, then the minimum m (Q4_K: dmin)
        data[..., 2:4] = torch.tensor([-0.05 if qtype == ops.QTYPES["Q4_1"] else 0.001],
                                      dtype=torch.float16).view(torch.uint8)
    return data.reshape(out, nb * bb)


def quant_rates(log=print, rounds: int = 7, types: tuple[str, ...] | None = None) -> dict:
    """Per GGUF type: the kernel's time at each of :data:`QUANT_ROWS` rows of x split into a
    cost per weight and one per output row (``rows_s_per_weight``, ``rows_s_per_output``: from
    :data:`QUANT_SHAPES_SPLIT`, which hold as many weights as :data:`QUANT_SHAPE`), and the decode
    cost per weight and FMA rate of :data:`QUANT_SHAPE` (one row, and the slope from one to
    :data:`ROWS` rows); over :data:`QUANT_STREAM_BYTES` of distinct matrices per pass (far beyond
    the caches, as a model's weights are). Types, shapes and row counts take turns, ``rounds``
    passes each spread over the measurement, and each figure is the median pass (a burst of other
    work on a shared machine then spoils a few passes, not one type's figure; the median, as the
    validation compares with the median of runs). ``types``: only these (default: every one)."""
    from stagewise import ops

    kinds = [name for name in QUANT_TYPES if types is None or name.lower() in types or name in types]

    narrow, wide = QUANT_SHAPES_SPLIT
    shapes_ = (QUANT_SHAPE, narrow, wide)
    weights = QUANT_SHAPE[0] * QUANT_SHAPE[1]
    mats, counts = {}, {}
    for name in kinds:
        qtype = ops.QTYPES[name]
        counts[name] = max(1, QUANT_STREAM_BYTES // (ops.quant_row_bytes(qtype, weights)))
        for shape in shapes_:
            mats[name, shape] = [random_blocks(*shape, qtype) for _ in range(counts[name])]
    xs = {(rows, k): torch.randn(rows, k) for rows in QUANT_ROWS for k in {s_[1] for s_ in shapes_}}
    t = {(name, shape, rows): [] for name in kinds for shape in shapes_ for rows in QUANT_ROWS}
    for (name, shape), ms in mats.items():
        for rows in QUANT_ROWS:
            ops.quant_linear(xs[rows, shape[1]], ms[0], ops.QTYPES[name])
    for _ in range(rounds):
        for (name, shape), ms in mats.items():
            qtype = ops.QTYPES[name]
            for rows in QUANT_ROWS:
                x = xs[rows, shape[1]]
                t0 = time.perf_counter()
                for m in ms:
                    ops.quant_linear(x, m, qtype)
                t[name, shape, rows].append((time.perf_counter() - t0) / counts[name])
    del mats
    result = {}
    for name in kinds:
        best = {(shape, rows): statistics.median(t[name, shape, rows]) for shape in shapes_ for rows in QUANT_ROWS}
        t1, tn = best[QUANT_SHAPE, 1], best[QUANT_SHAPE, ROWS]
        rate = 2 * (ROWS - 1) * weights / max(tn - t1, 1e-9)
        per_weight = max(t1 - 2 * weights / rate, 0.0) / weights
        per_out, per_w = {}, {}
        for rows in QUANT_ROWS:
            ta, tb = best[narrow, rows], best[wide, rows]
            c = max((tb - ta) / (wide[0] - narrow[0]), 0.0)
            per_out[str(rows)], per_w[str(rows)] = c, max(ta - narrow[0] * c, 0.0) / weights
        result[name.lower()] = {"s_per_weight": per_weight, "flops": rate, "rows_s_per_weight": per_w,
                                "rows_s_per_output": per_out, "shapes": [list(s_) for s_ in shapes_],
                                "matrices": counts[name], "passes": rounds,
                                "best_s": {f"{s_[0]}x{s_[1]}/{r}": v for (s_, r), v in best.items()}}
        log(f"  quant_linear {name}: {per_weight * 1e9:.3f} ns/weight to decode, {rate / 1e9:.1f} GFLOP/s of FMAs; "
            "at " + ", ".join(f"{r} rows {per_w[str(r)] * 1e9:.3f} ns/weight + {per_out[str(r)] * 1e9:.0f} ns/output"
                              for r in QUANT_ROWS)
            + f" ({counts[name]} matrices a shape, median of {rounds} passes)")
    return result


# ---- decode attention ---------------------------------------------------------------------

ATTN_HEAD_DIM, ATTN_BLOCK = 64, 16
ATTN_POINTS = ((1, 128, 8, 2), (4, 512, 8, 2), (4, 512, 8, 8))
"""(rows, cached tokens, query heads, KV heads) of the three timed calls: the first two differ in
FLOPs and cache bytes alike, the last two in cache bytes only (grouped-query vs one KV head a
query head)."""
ATTN_STREAM_BYTES = 64 << 20
"""Distinct paged caches cycled through, this many bytes of K/V in all (beyond the caches): in a
model the layers' weights stream through the caches between a layer's decode steps and evict
its KV, which then comes from memory."""


def attention_decode_rate(log=print, repeats: int = 5, calls: int = 200) -> dict:
    """:func:`stagewise.ops.decode_attention` as a decode step calls it (one new token per row over
    a paged float32 cache, the new K/V merged in): ``call_s + flops / flops_rate + cache_bytes /
    bandwidth`` with ``flops = 4 * heads * head_dim * rows * (cached + 1)`` and the K/V bytes read,
    solved through :data:`ATTN_POINTS` (each the median of ``repeats`` passes over
    :data:`ATTN_STREAM_BYTES` of caches)."""
    from stagewise import ops

    d, bs = ATTN_HEAD_DIM, ATTN_BLOCK
    gen = torch.Generator().manual_seed(0)
    points = []
    for rows, ctx, hq, hk in ATTN_POINTS:
        nblk = -(-(ctx + 1) // bs)
        layers = max(1, ATTN_STREAM_BYTES // (2 * rows * nblk * bs * hk * d * 4))
        caches = [(torch.randn(rows * nblk, bs, hk, d, generator=gen), torch.randn(rows * nblk, bs, hk, d, generator=gen))
                  for _ in range(layers)]
        tables = torch.arange(rows * nblk, dtype=torch.int32).view(rows, nblk)
        lens = torch.full((rows,), ctx, dtype=torch.int32)
        q = torch.randn(rows, hq, d, generator=gen)
        k_new, v_new = torch.randn(rows, hk, d, generator=gen), torch.randn(rows, hk, d, generator=gen)
        out = torch.empty_like(q)
        n = max(calls, layers)
        passes = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for i in range(n):
                kc, vc = caches[i % layers]
                ops.decode_attention(q, kc, vc, tables, lens, d ** -0.5, k_new=k_new, v_new=v_new, out=out)
            passes.append((time.perf_counter() - t0) / n)
        del caches
        points.append((4 * hq * d * rows * (ctx + 1), 2 * rows * (ctx + 1) * hk * d * 4, statistics.median(passes[1:])))
    (fa, ka, ta), (fb, kb, tb), (_, kc, tc) = points
    per_byte = max((tc - tb) / (kc - kb), 0.0)
    per_flop = max(((tb - per_byte * kb) - (ta - per_byte * ka)) / (fb - fa), 1e-15)
    call = max(ta - per_flop * fa - per_byte * ka, 0.0)
    bandwidth = 1.0 / per_byte if per_byte > 0 else float("inf")
    log(f"  decode attention: {1 / per_flop / 1e9:.1f} GFLOP/s, cache read at {bandwidth / 1e9:.1f} GB/s, "
        f"{call * 1e6:.1f} us a call (head dim {d}, paged float32 cache)")
    return {"flops": 1.0 / per_flop, "bandwidth": bandwidth, "call_s": call,
            "points": [{"rows": r, "cached": c, "heads": h, "kv_heads": k, "flops": f, "cache_bytes": b, "s": t}
                       for (r, c, h, k), (f, b, t) in zip(ATTN_POINTS, points)]}


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


# ---- pipeline links -------------------------------------------------------------------------

def _link_peer(kind: str, port: int, conn) -> None:
    """The receiving end: reports one-way times (receive time minus the frame's send stamp)."""
    torch.set_num_threads(1)
    from stagewise.transport import Hello, tcp
    from stagewise.transport.rings import upgrade_accepted

    hello = Hello(fingerprint="bench/profile", stage_from=0, stage_to=1)
    ch = tcp.connect("127.0.0.1", port, hello=hello, timeout=60)
    ch = upgrade_accepted(ch)  # continues on the transport the other end names
    times: dict[int, list[float]] = {}
    while True:
        f = ch.recv(timeout=60)
        now = time.perf_counter()
        ctl = f.control or {}
        if ctl.get("stop"):
            break
        times.setdefault(int(ctl["n"]), []).append(now - float(ctl["t"]))
    conn.send({n: statistics.median(v[3:]) for n, v in times.items()})
    ch.close()


def measure_link(kind: str) -> dict:
    """One-way time of frames of :data:`LINK_SIZES` bytes over the pipeline's ``kind`` link."""
    from stagewise.transport import Frame, Hello, StepKind, tcp
    from stagewise.transport.rings import upgrade_dialled

    hello = Hello(fingerprint="bench/profile", stage_from=0, stage_to=1)
    lis = tcp.listen(hello=hello)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_link_peer, args=(kind, lis.address[1], child), daemon=True)
    proc.start()
    try:
        ch = upgrade_dialled(lis.accept(120), kind)
        lis.close()
        for n in LINK_SIZES:
            hidden = torch.randn(n // 4 // 64, 64)
            for _ in range(LINK_FRAMES + 3):
                ch.send(Frame(step_kind=StepKind.DECODE, tensors={"hidden": hidden},
                              control={"n": n, "t": time.perf_counter()}))
                time.sleep(0.002 + n / 2e9)
        ch.send(Frame(step_kind=StepKind.CONTROL, control={"stop": True}))
        got = parent.recv() if parent.poll(60) else None
        ch.close()
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    if got is None:
        raise OSError(f"bench profile: the {kind} link peer reported nothing")
    small, big = LINK_SIZES
    t_small, t_big = got[small], got[big]
    bandwidth = (big - small) / max(t_big - t_small, 1e-9)
    latency = max(t_small - small / bandwidth, 0.0)
    return {"latency_s": latency, "bandwidth": bandwidth, "one_way_s": {str(k): v for k, v in got.items()},
            "what": f"stagewise.transport {kind} link between two processes, checksum on, one-way by timestamps"}

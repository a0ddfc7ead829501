"""The primitives of a device profile (:mod:`stagewise.planner.profiles`), each measured apart from
any end-to-end run: what a node profile (:mod:`stagewise.measure.node`) and ``stagewise bench
profile`` both time.

- matmul FLOP/s (``torch.mm`` of square matrices) and the op overhead (the median time of a tiny
  op: the dispatch cost every operator pays), timed by :func:`stagewise.measure.timing.time_fn`;
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
"""

from __future__ import annotations

import statistics
import time

import torch

from stagewise.measure.timing import TimingPolicy, time_fn

QUANT_SHAPE = (1024, 1536)  # out, in
QUANT_SHAPES_SPLIT = ((256, 6144), (4096, 384))
"""As many weights as :data:`QUANT_SHAPE` in 16 times the output rows between them: the pair gives
the kernel's cost per weight and per output row (its tiles' reductions and stores)."""
QUANT_STREAM_BYTES = 96 << 20
ROWS = 32
QUANT_ROWS = (1, 2, 4, ROWS)
"""Rows of x the block-quantised linear is timed with: the direct kernel runs register tiles of a
few rows against each decoded block, so its cost is not linear from one row to a few."""
QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
"""The GGUF types the planner models (its --weight-quant / --embed-quant choices)."""


# ---- matmul and op overhead ----------------------------------------------------------------

def matmul_flops(dtype: torch.dtype, device: str, n: int, policy: TimingPolicy) -> dict:
    """``torch.mm`` of two ``n`` x ``n`` matrices of ``dtype``: ``2 n^3`` FLOPs over the median time."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = time_fn(lambda: torch.mm(a, b), device, policy)
    return {"n": n, "median_ms": t.median_ms, "flops": 2 * n**3 / (t.median_ms / 1e3)}


def op_overhead(device: str, policy: TimingPolicy) -> float:
    """Seconds of a tiny op (64 floats added): what dispatching any operator costs."""
    x = torch.ones(64, device=device)
    return time_fn(lambda: torch.add(x, x), device, policy).median_ms / 1e3


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


def split_time(t_narrow: float, t_wide: float, out_narrow: int, out_wide: int, weights: int) -> tuple[float, float]:
    """Seconds per weight and per output row from the times of two matrices of ``weights`` weights
    each, ``out_narrow`` and ``out_wide`` rows: ``t = weights * per_weight + out * per_output``. When
    the two are too close for the noise to leave both parts positive, all of the time is taken per
    weight (a profile's per-weight costs are positive)."""
    per_out = (t_wide - t_narrow) / (out_wide - out_narrow)
    if per_out <= 0 or t_narrow - out_narrow * per_out <= 0:
        per_out = 0.0
    return (t_narrow - out_narrow * per_out) / weights, per_out


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
            per_w[str(rows)], per_out[str(rows)] = split_time(best[narrow, rows], best[wide, rows],
                                                              narrow[0], wide[0], weights)
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

"""The runtime's own primitive costs, measured for the planner's CPU model (part of `stagewise bench profile`).

Groups of figures, each measured apart from any end-to-end run (the planner's validation compares
against those; nothing here looks at them):

- ``quant``: :func:`stagewise.ops.quant_linear` per GGUF type, 96 MiB of distinct matrices a
  pass (so that the weights come from memory, not the caches), at 1, 2, 4 and ``ROWS`` rows of
  x. The kernel dequantises each 16-row panel once per call and runs register tiles of rows of
  ``x`` against it, so 2 rows cost about what 4 do; two shapes of as many weights and 16 times
  the output rows apart split each row count's time into a cost per weight and per output row.
  Also ``s_per_weight`` (one row minus its FMAs) and ``flops_rate`` (slope from 1 to ``ROWS``
  rows) on 1024 x 1536 matrices. Each the median of passes spread over the measurement.
- ``attention_decode``: :func:`stagewise.ops.decode_attention` over paged caches streamed from
  memory (as a model's layers leave them), per call, per FLOP and per cached K/V byte.
- ``framework``: the Python + dispatcher cost the engine pays per decode step. ``layer_s`` from
  a synthetic llama whose weights stream through the caches (:data:`STREAM_MODEL`): the step's
  wall time minus its kernels' self time (torch profiler), over the layers; the fixed part of one
  step per role from a llama of negligible width (hidden 64, vocab 512, Q4_1 linears, Q8_0 tied
  embedding) whose arithmetic is a few microseconds: ``engine`` (the single-process engine:
  schedule, metadata, model, sample, record), ``head`` (stage 0's launch: schedule, metadata,
  embedding, its layers), ``middle`` and ``last`` (a later stage's run: KV bookkeeping,
  metadata, layers; the last also final norm, LM head and sampling) and ``tokens`` (stage 0
  taking a step's sampled tokens back).
- ``links``: one-way latency and bandwidth of the real pipeline transports
  (``stagewise.transport`` tcp and shm channels, checksum on as the pipeline runs them) between
  two processes: frames of a float32 hidden tensor carry their send time (CLOCK_MONOTONIC,
  shared by the processes of a host), the receiver takes the difference after decoding; paced
  so that no frame queues. Latency = the small frame's time minus its bytes at the fitted
  bandwidth; bandwidth from the slope between the small and the large frame.
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
"""Rows of x the block-quantised linear is timed with: the kernel runs register tiles of a few
rows against each decoded panel, so its cost is not linear from one row to a few."""
LAYERS_HI = 5
LINK_SIZES = (2304, 1 << 20)  # bytes of the hidden tensor: a SmolLM2-sized decode row, and 1 MiB
LINK_FRAMES = 60


# ---- quant_linear --------------------------------------------------------------------------

def random_blocks(out: int, inp: int, qtype: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """Valid GGUF blocks ``[out, inp / 32 * block_bytes]`` with random quants and small, normal scales."""
    from stagewise import ops

    nb, bb = inp // ops.QUANT_BLOCK, ops.QUANT_BLOCK_BYTES[qtype]
    data = torch.randint(0, 256, (out, nb, bb), dtype=torch.uint8, generator=gen)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    data[..., 0:2] = scale
    if qtype == ops.QTYPES["Q4_1"]:  # d, then the minimum m
        data[..., 2:4] = torch.tensor([-0.05], dtype=torch.float16).view(torch.uint8)
    return data.reshape(out, nb * bb)


def quant_rates(log=print, rounds: int = 7) -> dict:
    """Per GGUF type: the kernel's time at each of :data:`QUANT_ROWS` rows of x split into a
    cost per weight and one per output row (``rows_s_per_weight``, ``rows_s_per_output``: from
    :data:`QUANT_SHAPES_SPLIT`, which hold as many weights as :data:`QUANT_SHAPE`), and the decode
    cost per weight and FMA rate of :data:`QUANT_SHAPE` (one row, and the slope from one to
    :data:`ROWS` rows); over :data:`QUANT_STREAM_BYTES` of distinct matrices per pass (far beyond
    the caches, as a model's weights are). Types, shapes and row counts take turns, ``rounds``
    passes each spread over the measurement, and each figure is the median pass (a burst of other
    work on a shared machine then spoils a few passes, not one type's figure; the median, as the
    validation compares with the median of runs)."""
    from stagewise import ops

    narrow, wide = QUANT_SHAPES_SPLIT
    shapes_ = (QUANT_SHAPE, narrow, wide)
    weights = QUANT_SHAPE[0] * QUANT_SHAPE[1]
    mats, counts = {}, {}
    for name, qtype in ops.QTYPES.items():
        counts[name] = max(1, QUANT_STREAM_BYTES // (weights // ops.QUANT_BLOCK * ops.QUANT_BLOCK_BYTES[qtype]))
        for shape in shapes_:
            mats[name, shape] = [random_blocks(*shape, qtype) for _ in range(counts[name])]
    xs = {(rows, k): torch.randn(rows, k) for rows in QUANT_ROWS for k in {s_[1] for s_ in shapes_}}
    t = {(name, shape, rows): [] for name in ops.QTYPES for shape in shapes_ for rows in QUANT_ROWS}
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
    for name in ops.QTYPES:
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


# ---- framework overhead of the runtime ------------------------------------------------------------

def tiny_config(num_layers: int, hidden: int = 64, intermediate: int = 128, heads: int = 2, kv_heads: int = 1):
    """A synthetic llama (head dim ``hidden / heads``); the default is of negligible width."""
    from stagewise.model.config import ModelConfig

    return ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": num_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "rope_theta": 10000.0, "hidden_act": "silu"})


def tiny_weights(config) -> dict:
    """HF-named weights: Q4_1 linears, a Q8_0 tied embedding, float32 norms."""
    from stagewise import ops
    from stagewise.model.quant import QuantizedWeight

    gen = torch.Generator().manual_seed(0)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q4, q8 = ops.QTYPES["Q4_1"], ops.QTYPES["Q8_0"]

    def q(out: int, inp: int, qtype: int = q4) -> QuantizedWeight:
        return QuantizedWeight(random_blocks(out, inp, qtype, gen), qtype, inp)

    w = {"model.embed_tokens.weight": q(config.vocab_size, h, q8), "model.norm.weight": torch.ones(h)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        w |= {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
              p + "self_attn.q_proj.weight": q(config.num_heads * d, h),
              p + "self_attn.k_proj.weight": q(config.num_kv_heads * d, h),
              p + "self_attn.v_proj.weight": q(config.num_kv_heads * d, h),
              p + "self_attn.o_proj.weight": q(h, config.num_heads * d),
              p + "mlp.gate_proj.weight": q(i, h), p + "mlp.up_proj.weight": q(i, h),
              p + "mlp.down_proj.weight": q(h, i)}
    return w


def _median_step(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _tiny_engine(cfg, prompt: int, steps: int, weights: dict | None = None):
    from stagewise.model.stage import StageModel
    from stagewise.runtime.engine import Engine
    from stagewise.runtime.sampling import SamplingParams

    weights = tiny_weights(cfg) if weights is None else weights
    eng = Engine(StageModel.from_weights(cfg, 0, cfg.num_layers, weights), max_num_seqs=1,
                 max_model_len=prompt + 2 * steps + 16)
    eng.add_request(0, list(range(1, prompt + 1)), SamplingParams(max_new_tokens=2 * steps + 8, temperature=0.0,
                                                                   ignore_eos=True))
    eng.step()  # prefill
    for _ in range(2):
        eng.step()
    return eng


def _engine_step_s(layers: int, prompt: int, steps: int) -> float:
    return _median_step(_tiny_engine(tiny_config(layers), prompt, steps).step, steps)


KERNELS = ("stagewise::quant_linear", "stagewise::decode_attention")
"""The ops the planner times with their own primitives (``quant``, ``attention_decode``)."""
STREAM_MODEL = {"hidden": 512, "intermediate": 1536, "heads": 8, "kv_heads": 2, "layers": 24}
"""A synthetic llama whose Q4_1 weights (about 1.9 MB a layer, 45 MB in all) exceed the caches."""


def streamed_layer_s(prompt: int = 128, steps: int = 20, rounds: int = 7) -> dict:
    """The framework's cost per decoder layer when the layers' weights stream through the caches
    between its Python/dispatch work, as a real model's do (the negligible-width model keeps
    everything hot). Decode steps of :data:`STREAM_MODEL`, in ``rounds`` of two passes of
    ``steps / 2`` each of a new request (prompt ``prompt``): one timed (median wall time of a
    step), one under the torch profiler for the self time of :data:`KERNELS` per step (the profiler
    slows the Python around them, not the kernels); the median round's difference (over the layers:
    the caller's). Medians, as the validation compares with the median of runs."""
    from torch.profiler import ProfilerActivity, profile

    m = STREAM_MODEL
    cfg = tiny_config(m["layers"], m["hidden"], m["intermediate"], m["heads"], m["kv_heads"])
    weights = tiny_weights(cfg)
    step_runs, kernel_runs = [], []
    for _ in range(rounds):  # a new request each round: every round at the same contexts
        eng = _tiny_engine(cfg, prompt, steps, weights)
        step_runs.append(_median_step(eng.step, steps // 2))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps // 2):
                eng.step()
        kernel_runs.append(sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in KERNELS) * 1e-6
                           / (steps // 2))
    per = sorted(a - b for a, b in zip(step_runs, kernel_runs))
    return {"step_s": statistics.median(step_runs), "kernels_s": statistics.median(kernel_runs),
            "framework_s": max(per[len(per) // 2], 0.0), "layers": m["layers"], "model": dict(m),
            "step_runs_s": step_runs, "kernel_runs_s": kernel_runs}


def _head_step_s(layers: int, prompt: int, steps: int) -> tuple[float, float]:
    """Stage 0 of a ``layers + 1``-layer model: (launch of a decode step, taking its tokens back)."""
    from stagewise.model.stage import StageModel
    from stagewise.runtime.pipeline_head import PipelineHead
    from stagewise.runtime.sampling import SamplingParams

    cfg = tiny_config(layers + 1)
    head = PipelineHead(StageModel.from_weights(cfg, 0, layers, tiny_weights(cfg)), num_groups=1, num_blocks=64,
                        max_num_seqs=1, max_model_len=prompt + steps + 8)
    head.add_request(0, list(range(1, prompt + 1)), SamplingParams(max_new_tokens=steps + 8, temperature=0.0,
                                                                    ignore_eos=True))
    launch, back = [], []
    for k in range(steps + 3):
        t0 = time.perf_counter()
        step, _ = head.launch(0)
        t1 = time.perf_counter()
        head.on_tokens(0, step.step_id, list(step.batch.request_ids), [7] * len(step.batch.request_ids))
        t2 = time.perf_counter()
        if k >= 3:  # after the prefill and two warm-up decodes
            launch.append(t1 - t0)
            back.append(t2 - t1)
    return statistics.median(launch), statistics.median(back)


def _later_step_s(layers: int, last: bool, prompt: int, steps: int) -> float:
    """A later stage running ``layers`` layers (the last one: also final norm, LM head, sampling)."""
    from stagewise.model.stage import StageModel
    from stagewise.runtime.stage_runtime import StageRuntime, StepRow

    total = layers + 1 if last else layers + 2
    cfg = tiny_config(total)
    model = StageModel.from_weights(cfg, 1, 1 + layers, tiny_weights(cfg))
    rt = StageRuntime(model, num_blocks=64, block_size=16, max_model_len=prompt + steps + 8)
    h = cfg.hidden_size
    sampling = {0: {"temperature": 0.0, "max_new_tokens": steps + 8, "ignore_eos": True}}
    rt.run([StepRow(0, 0, prompt, True)], torch.randn(prompt, h), sampling)
    pos = [prompt]

    def one() -> None:
        rt.run([StepRow(0, pos[0], 1, False)], torch.randn(1, h))
        pos[0] += 1

    for _ in range(2):
        one()
    return _median_step(one, steps)


def framework_overheads(log=print, prompt: int = 128, steps: int = 40, repeats: int = 5) -> dict:
    """Per decode step (batch 1): ``layer_s`` and the fixed part of each role (see the module doc);
    each the least disturbed of ``repeats`` medians (this machine is shared)."""
    def med(fn):
        return min(fn() for _ in range(repeats))

    lo, hi = 1, LAYERS_HI
    eng = {n: med(lambda n=n: _engine_step_s(n, prompt, steps)) for n in (lo, hi)}
    layer = max((eng[hi] - eng[lo]) / (hi - lo), 0.0)
    head_runs = [_head_step_s(lo, prompt, steps) for _ in range(repeats)]
    head = min(r[0] for r in head_runs)
    tokens = min(r[1] for r in head_runs)
    middle = med(lambda: _later_step_s(lo, False, prompt, steps))
    last = med(lambda: _later_step_s(lo, True, prompt, steps))
    # Per layer with the weights streaming; the engine's fixed part from the negligible-width model.
    streamed = streamed_layer_s(prompt)
    fixed = max(eng[lo] - lo * layer, 0.0)
    hot_layer, layer = layer, max((streamed["framework_s"] - fixed) / streamed["layers"], 0.0)
    out = {"layer_s": layer, "engine_s": fixed, "head_s": max(head - lo * hot_layer, 0.0),
           "middle_s": max(middle - lo * hot_layer, 0.0), "last_s": max(last - lo * hot_layer, 0.0), "tokens_s": tokens,
           "raw": {"engine_step_s": eng, "head_launch_s": head, "middle_run_s": middle, "last_run_s": last,
                   "model": "llama hidden 64, vocab 512, Q4_1 linears, Q8_0 embedding", "prompt": prompt,
                   "hot_layer_s": hot_layer, "streamed": streamed}}
    log(f"  framework per decode step: {layer * 1e6:.0f} us/layer with streamed weights "
        f"({hot_layer * 1e6:.0f} with hot caches); fixed: engine {out['engine_s'] * 1e6:.0f} us, "
        f"head {out['head_s'] * 1e6:.0f}, middle {out['middle_s'] * 1e6:.0f}, last {out['last_s'] * 1e6:.0f}, "
        f"tokens back {tokens * 1e6:.0f} us")
    return out


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

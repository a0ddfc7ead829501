"""`stagewise bench e2e --cuda-graphs`: the batch-1 decode step on a GPU run eagerly against the
same step replayed from one CUDA graph, each beside the memory floor.

The model is one stage of every layer, loaded as the engine loads it (:func:`load_stage`, a
:class:`KVCacheManager` and :class:`KVCache` in the model's dtype, blocks of the engine's size). One
prompt of ``--prompt-len`` tokens is prefilled; then each decode step is the stage's forward to the
logits plus their argmax (the greedy token), its inputs built as the engine builds them
(:class:`StepBatch`, :meth:`KVMetadata.build`) before the timed part.

What the decode forward of a stage on one rank reads, and so what the graph's static inputs are:
the step's ``token_ids [1]`` (the embedding) and ``positions [1]`` (rope), and of its metadata
``slot_mapping [1]`` (the cache write), ``block_tables [1, W]`` and ``seq_lens [1]`` (decode
attention). ``W`` is the manager's fixed ``max_blocks_per_seq``, so the shapes never change, and
decode attention picks its split count from ``W`` (never from ``seq_lens``, which stays on the
device): the graph captured at the first decode position is valid at every later one once those
five tensors are copied in place. The step's Python-side fields (``query_lens``, ``num_prefills``)
are the same for every batch-1 decode step; ``context_lens`` is read only by
:meth:`KVMetadata.build` and the prefill and context-parallel paths, never by this step.

Before anything is timed the graph's logits are checked against the eager step's on the same inputs
at :data:`VERIFY_STEPS` successive positions (bitwise, else within :data:`TOLERANCE`), and again at
every timed position. Timing: ``--new-tokens - 1`` decode steps after those,
each position timed ``--repeats`` times eagerly and as a replay, taking turns, between CUDA events
on a synchronised stream; the figure is the median ms/step. The memory floor is
:func:`~stagewise.bench.e2e.compare.memory_floor`'s: weights and KV read at the copy bandwidth
measured in the same run.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import traceback
from pathlib import Path

import torch

from stagewise.engine.executor import model_dtype
from stagewise.int_tensors import int_tensor
from stagewise.kv import KVCache, KVCacheManager
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata

VERIFY_STEPS = 4
"""Successive decode positions whose graph logits must equal the eager ones before any timing."""
CAPTURE_WARMUP = 2
"""Eager runs on a side stream before capture, as torch's CUDA graph notes ask (lazy init, the allocator)."""
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-3}
"""Largest |graph - eager| of a logit accepted when they are not bitwise equal, relative to the
largest |logit| (at least 1): a few ulps of each dtype at that magnitude (float32: what another
reduction order leaves after a few layers). The same kernels on the same inputs should give the same
bits; a difference within this says a kernel chose another reduction order under capture, while a
graph reading stale inputs (a position, a slot, a length) moves the logits by far more. The argmax
is not required to agree: random weights leave near ties that one ulp flips."""
RID = 0


class DecodeSteps:
    """One request's batch-1 decode steps on ``stage`` (every layer, on a GPU): eager, and replayed
    from a CUDA graph over static inputs (:meth:`capture`, :meth:`load`, :meth:`replay`)."""

    def __init__(self, stage, block_size: int, max_len: int, device) -> None:
        spec = stage.kv_cache_spec(block_size, model_dtype(stage))
        if spec.group_windows != (None,):
            raise ValueError(f"--cuda-graphs runs models without sliding-window layers (one KV pool); this one has "
                             f"windows {spec.group_windows}")
        blocks = -(-max_len // block_size)
        self.manager = KVCacheManager(block_size=block_size, num_blocks=blocks, max_blocks_per_seq=blocks)
        self.cache = KVCache(spec, num_blocks=blocks, device=device)
        self.stage, self.device, self.length = stage, torch.device(device), 0
        self.graph = self.static = self.out = None

    def prefill(self, prompt: list[int]) -> int:
        """The prompt's K/V into the cache; its greedy next token."""
        self.manager.add(RID, len(prompt))
        batch = StepBatch(request_ids=(RID,), num_prefills=1, query_lens=(len(prompt),), context_lens=(0,),
                          positions=torch.arange(len(prompt), device=self.device),
                          token_ids=torch.tensor(prompt, device=self.device))
        logits = self.stage(batch, self.cache, KVMetadata.build(batch, self.manager, self.device))
        self.length = len(prompt)
        return int(logits[-1].argmax())

    def inputs(self, token: int):
        """The decode step of ``token`` at the next position, as the engine builds it: its slot taken
        in the manager, its (batch, metadata) on the device."""
        self.manager.append(RID)
        batch = StepBatch(request_ids=(RID,), num_prefills=0, query_lens=(1,), context_lens=(self.length,),
                          positions=int_tensor([self.length], device=self.device),
                          token_ids=int_tensor([token], device=self.device))
        meta = KVMetadata.build(batch, self.manager, self.device)
        extra = [n for n in ("local_seq_lens", "pcp", "cp_rows", "cp_block_tables", "cp_local_lens", "query_start_loc",
                             "run_lens") if getattr(meta, n) is not None]
        if extra or meta.cp_world_size != 1:  # the static inputs below would not hold them
            raise ValueError(f"--cuda-graphs: a decode step's metadata holds {extra or 'context parallelism'}")
        self.length += 1
        return batch, meta

    def eager(self, batch, meta):
        """(logits [1, vocab], greedy token [1]) of one step."""
        logits = self.stage(batch, self.cache, meta)
        return logits, logits.argmax(-1)

    def capture(self, batch, meta) -> None:
        """The graph of one decode step over static copies of ``batch``'s and ``meta``'s inputs (the
        step runs a few times first, its K/V written where the step itself writes them)."""
        static_batch = dataclasses.replace(batch, positions=batch.positions.clone(), token_ids=batch.token_ids.clone())
        static_meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.clone(),
                                          block_tables=meta.block_tables.clone(), seq_lens=meta.seq_lens.clone())
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(CAPTURE_WARMUP):
                self.eager(static_batch, static_meta)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # The outer context puts this stream back should capture fail: torch.cuda.graph's exit ends the
        # capture first and, when that raises, never leaves its capture stream.
        with torch.cuda.stream(torch.cuda.current_stream(self.device)), torch.cuda.graph(graph):
            out = self.eager(static_batch, static_meta)
        self.graph, self.static, self.out = graph, (static_batch, static_meta), out

    def load(self, batch, meta) -> None:
        """A step's inputs into the graph's static tensors, in place (stream-ordered before a replay)."""
        static_batch, static_meta = self.static
        static_batch.token_ids.copy_(batch.token_ids)
        static_batch.positions.copy_(batch.positions)
        for name in ("slot_mapping", "block_tables", "seq_lens"):
            getattr(static_meta, name).copy_(getattr(meta, name))

    def replay(self):
        """(logits, token) of the loaded step: the graph's own output tensors, overwritten by the next replay."""
        self.graph.replay()
        return self.out


def agreement(eager, graph, dtype: str) -> dict:
    """Graph logits against eager logits of the same step (see :data:`TOLERANCE`)."""
    e, g = eager.float(), graph.float()
    diff = float((e - g).abs().max())
    bound = TOLERANCE[dtype] * max(1.0, float(e.abs().max()))
    bitwise = bool(eager.equal(graph))
    return {"bitwise": bitwise, "max_abs_diff": diff, "same_token": bool((e.argmax(-1) == g.argmax(-1)).all()),
            "ok": bitwise or diff <= bound}


def _timed(fn, events):
    torch.cuda.synchronize()
    start, end = events
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), out


def _failure(err: BaseException) -> dict:
    """What stopped the graph: the error (the one under it when torch.cuda.graph's exit, ending the
    capture, raised its own over it) and the innermost stagewise frame it came through."""
    first = err if err.__context__ is None or err.__suppress_context__ else err.__context__
    package = Path(__file__).resolve().parents[2]
    frames = [f for f in traceback.extract_tb(first.__traceback__)
              if Path(f.filename).resolve().is_relative_to(package)]
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" if frames else None
    lines = (lambda e: f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")
    return {"error": lines(first), "where": where, **({"then": lines(err)} if first is not err else {})}


def measure(steps: DecodeSteps, prompt: list[int], new_tokens: int, repeats: int, dtype: str, log=print) -> dict:
    """Prefill ``prompt``; capture and check the graph over :data:`VERIFY_STEPS` positions; then time
    ``new_tokens - 1`` positions, eager and replayed, ``repeats`` times each."""
    token = steps.prefill(prompt)
    checks, capture = [], {"ok": False, "error": None, "where": None}
    for i in range(VERIFY_STEPS):
        batch, meta = steps.inputs(token)
        logits, next_token = steps.eager(batch, meta)
        if i == 0:
            try:
                steps.capture(batch, meta)
                capture["ok"] = True
            except Exception as err:  # any failure to capture is a finding, reported in the results
                # What breaks capture in this step, and what would have to change: a host read of a
                # device value (.item(), .tolist(), int() or a Python branch on a tensor) in a layer or
                # an op's glue; a tensor made from Python values inside the step (torch.tensor(...,
                # device=...) copies from pageable memory, e.g. VocabEmbedding's scale of Gemma); or a
                # CPU tensor an op reads (metadata built on the CPU). The fix goes where `where` points:
                # the tensor made once at load (a buffer), the metadata kept on the device.
                capture.update(_failure(err))
                torch.cuda.synchronize()
                log(f"bench e2e --cuda-graphs: capture failed: {capture['error']} (at {capture['where']})")
        if capture["ok"]:
            steps.load(batch, meta)
            graph_logits, _ = steps.replay()
            checks.append({"position": steps.length - 1, **agreement(logits, graph_logits, dtype)})
        token = int(next_token)
    verified = capture["ok"] and all(c["ok"] for c in checks)
    if capture["ok"] and not verified:
        log(f"bench e2e --cuda-graphs: graph logits differ from eager ones: {checks}; timing the eager step only")
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    eager_ms, graph_ms, timed_checks = [], [], []
    first = steps.length
    for _ in range(new_tokens - 1):
        batch, meta = steps.inputs(token)
        if verified:
            steps.load(batch, meta)
        for _ in range(repeats):  # a step run again writes the same K/V to the same slot
            ms, (logits, next_token) = _timed(lambda: steps.eager(batch, meta), events)
            eager_ms.append(ms)
            if verified:
                ms, (graph_logits, _) = _timed(steps.replay, events)
                graph_ms.append(ms)
        if verified:
            timed_checks.append(agreement(logits, graph_logits, dtype))
        token = int(next_token)
    return {"capture": capture, "verified": verified, "checks": checks,
            "timed_positions": [first, steps.length - 1],
            "timed_bitwise": sum(c["bitwise"] for c in timed_checks), "timed_ok": sum(c["ok"] for c in timed_checks),
            "timed_max_abs_diff": max((c["max_abs_diff"] for c in timed_checks), default=None),
            "eager_ms": eager_ms, "graph_ms": graph_ms}


def summarise(got: dict, floor: dict) -> list[dict]:
    """A row per way of running the step that was timed: median and least ms/step, tokens/s, and the
    floor's share of the step (the floor's ms over the step's: 1 would be the memory bound)."""
    rows = []
    for mode, ms in (("eager", got["eager_ms"]), ("CUDA graph", got["graph_ms"])):
        if ms:
            median = statistics.median(ms)
            rows.append({"mode": mode, "step_ms": median, "min_ms": min(ms), "tokens_per_s": 1e3 / median,
                         "floor_fraction": floor["floor_step_ms"] / median, "samples": len(ms)})
    if len(rows) == 2:
        rows[1]["speedup"] = rows[0]["step_ms"] / rows[1]["step_ms"]
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| decode step | ms/step | least ms | tok/s | % of floor | speed-up |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['step_ms']:.3f} | {r['min_ms']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{100 * r['floor_fraction']:.0f} % | {r.get('speedup', 1.0):.2f}x |")
    return "\n".join(lines)


def _check_line(got: dict) -> str:
    capture = got["capture"]
    if not capture["ok"]:
        return f"Capture failed: {capture['error']} (at {capture['where']}); only the eager step was timed."
    checks = got["checks"]
    n = got["timed_positions"][1] - got["timed_positions"][0] + 1 if got["graph_ms"] else 0
    return (f"Graph logits against eager logits of the same inputs at positions {[c['position'] for c in checks]}: "
            f"{'bitwise equal' if all(c['bitwise'] for c in checks) else 'NOT bitwise equal'}, max |diff| "
            f"{max(c['max_abs_diff'] for c in checks):.3g} ({'accepted' if got['verified'] else 'REFUSED'}); at the "
            f"{n} timed positions {got['timed_bitwise']} bitwise equal, {got['timed_ok']} accepted.")


def run(args, log=print) -> int:
    """The mode: check the arguments and the GPU, load, measure, write <device>-e2e-cuda-graphs.json/.md.
    Exit status 2 without a CUDA GPU (or a bad argument), 1 when the graph's logits differ from the
    eager step's, else 0 (also when capture failed: the reason is in the results)."""
    if args.device == "cpu" or not torch.cuda.is_available():
        why = ("needs --device cuda, got --device cpu" if args.device == "cpu" else
               f"needs a CUDA GPU, and torch {torch.__version__} sees none (torch.cuda.is_available() is False)")
        print(f"stagewise bench e2e: --cuda-graphs times the decode step under CUDA graphs and {why}", file=sys.stderr)
        return 2
    from stagewise.bench import report
    from stagewise.bench.e2e import random_models
    from stagewise.bench.e2e.compare import memory_floor
    from stagewise.bench.e2e.prompts import make_prompts
    from stagewise.engine.engine import DEFAULT_BLOCK_SIZE
    from stagewise.measure.timing import TimingPolicy, copy_bandwidth
    from stagewise.model.loader import open_checkpoint, resolve_dtype
    from stagewise.model.loader.stage_weights import keeps_quantized
    from stagewise.model.stage import load_stage

    repeats = args.repeats or 3
    try:
        if args.prompt_len < 1 or args.new_tokens < 2 or repeats < 1:
            raise ValueError(f"--cuda-graphs needs --prompt-len >= 1, --new-tokens >= 2 and --repeats >= 1; got "
                             f"{args.prompt_len}, {args.new_tokens}, {repeats}")
        # A random model is built (once) only now, after the GPU check: bench e2e's run hands over before.
        args.model = random_models.resolve(args.model, getattr(args, "random_layers", None), log)
        ckpt = open_checkpoint(args.model)
        cfg = ckpt.config
        dtype = resolve_dtype(str(getattr(args, "dtype", None) or "float32"), cfg.dtype)
        max_len = args.prompt_len + VERIFY_STEPS + args.new_tokens
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"--prompt-len + {VERIFY_STEPS} checked steps + --new-tokens = {max_len} positions, past "
                             f"the model's max_position_embeddings {cfg.max_position_embeddings}")
    except (FileNotFoundError, ValueError) as err:
        print(f"stagewise bench e2e: {err}", file=sys.stderr)
        return 2
    dtype_name = str(dtype).removeprefix("torch.")
    info = report.machine_info("cuda")
    copy_bw = copy_bandwidth("cuda", 2**24 if args.tiny else 2**30, TimingPolicy(warmup=2, min_repeats=3,
                                                                                 max_repeats=20, budget_s=0.5))
    log(f"{info['device_name']}: copy bandwidth {copy_bw['gbps']:.1f} GB/s; loading {args.model} ({dtype_name}) ...")
    try:
        stage = load_stage(ckpt, 0, cfg.num_layers, dtype=dtype, device="cuda")
        steps = DecodeSteps(stage, DEFAULT_BLOCK_SIZE, max_len, "cuda")
    except (ValueError, NotImplementedError) as err:
        print(f"stagewise bench e2e: {err}", file=sys.stderr)
        return 2
    with torch.inference_mode():
        got = measure(steps, make_prompts(ckpt, 1, args.prompt_len)[0], args.new_tokens, repeats, dtype_name, log)
    # Quantised GGUF matrices stay in their blocks in float32 (then the floor reads the file's bytes);
    # in another dtype they are dequantised, and the floor counts them in it.
    floor = memory_floor(cfg, 1, got["timed_positions"][0], args.new_tokens, dtype.itemsize, copy_bw["gbps"],
                         ckpt if keeps_quantized(dtype, None) else None)
    rows = summarise(got, floor)
    info.update(model=str(args.model), dtype=dtype_name, layers=cfg.num_layers, block_size=DEFAULT_BLOCK_SIZE,
                prompt_len=args.prompt_len, verify_steps=VERIFY_STEPS, timed_steps=args.new_tokens - 1,
                repeats=repeats, tolerance=TOLERANCE[dtype_name])
    table = format_table(rows)
    print(table)
    first, last = got["timed_positions"]
    report.write_results(args.out, f"{info['device']}-e2e-cuda-graphs", {
        "machine": info, "copy_bandwidth": copy_bw, "floor": floor, "rows": rows,
        "speedup": rows[1]["speedup"] if len(rows) == 2 else None,
        **{k: got[k] for k in ("capture", "verified", "checks", "timed_positions", "timed_bitwise", "timed_ok",
                               "timed_max_abs_diff")}}, [
        "# stagewise end to end: the batch-1 decode step, eager and from a CUDA graph", "",
        f"Machine: {info['device_name']} ({info['device']}); torch {info['torch']}, CUDA {info['cuda']}  ",
        f"Date (UTC): {info['date_utc']}; commit: {info['git_commit']}  ",
        f"Model: {info['model']}, {dtype_name}, one stage of {cfg.num_layers} layers, KV blocks of "
        f"{DEFAULT_BLOCK_SIZE}; a prompt of {args.prompt_len} tokens, {VERIFY_STEPS} decode steps checked, then "
        f"{args.new_tokens - 1} timed (positions {first}-{last}), each {repeats} times eagerly and replayed, taking "
        "turns; median  ",
        f"Copy bandwidth (read + write): {copy_bw['gbps']:.1f} GB/s; floor {floor['floor_step_ms']:.3f} ms/step: "
        f"{floor['bytes_per_step_mean'] / 1e6:.2f} MB a step (weights {floor['weight_bytes_per_step'] / 1e6:.2f} MB, "
        f"KV {floor['kv_bytes_per_step_mean'] / 1e6:.2f} MB on average) at that bandwidth", "",
        "decode step = the stage's forward to the logits plus their argmax, inputs built before the timed part "
        "(CUDA events on a synchronised stream); % of floor = the floor's ms over the step's; speed-up = eager "
        "ms over graph ms. The issue's target: the graph at >= 70 % of the floor.", "",
        _check_line(got), "", table, ""], log)
    if got["capture"]["ok"] and (not got["verified"] or got["timed_ok"] < last - first + 1):
        print("stagewise bench e2e: the CUDA graph's logits differ from the eager step's (see the results)",
              file=sys.stderr)
        return 1
    return 0

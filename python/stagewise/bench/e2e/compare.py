"""`stagewise bench e2e` by default: time to first token and decode tokens/s of stagewise.Pipeline
against its baselines (:mod:`stagewise.bench.e2e.baselines`: transformers ``generate``, and with
``--baseline llama.cpp`` llama.cpp on the same GGUF file) on the same weights, threads and prompts.

Every row of a batch gets a prompt of exactly ``prompt_len`` tokens (windows of one fixed text)
and decodes exactly ``new_tokens`` tokens (EOS ignored on every side), greedy. Runs of ours and of
the baselines alternate so that a noisy machine slows all alike; each figure is the median over the
timed runs, after one short untimed warm-up of each.

Ours runs once per linear precision asked for (``--linear-precision``, default ``exact,int8``;
int8 over the GGUF blocks, or over Q8_0 blocks quantised at load for a dense float32
checkpoint): each gets its own result row, and its runs alternate with the same baseline runs, so
every ratio is measured side by side. Ours and transformers compute in ``--dtype`` (default
float32); the int8 mode only in float32, and on the CPU: elsewhere it is skipped, saying why.

TTFT is the time from submitting the batch to its first sampled token (the prefill). Decode
tokens/s counts every token after each row's first, summed over the batch, over the time from
the first token to the last. The memory floor is the decode time if every step only had to read
its bytes (weights + KV cache) at the copy bandwidth measured in the same run. Start-up rows
(:mod:`stagewise.bench.e2e.startup`) time fresh processes to their first output.
"""

from __future__ import annotations

import statistics

import torch

from stagewise.bench.e2e.baselines import BASELINES, Run, open_baseline
from stagewise.bench.e2e.prompts import make_prompts
from stagewise.model.config import ModelConfig
from stagewise.model.loader import Checkpoint

def run_ours(pipe, prompts: list[list[int]], new_tokens: int, images=None) -> Run:
    completions = pipe.generate(prompt_token_ids=prompts, max_new_tokens=new_tokens, ignore_eos=True,
                                images=None if images is None else [images] * len(prompts))
    bad = [c.error or c.finish_reason for c in completions if len(c.token_ids) != new_tokens]
    if bad:
        raise RuntimeError(f"bench e2e: stagewise rows ended early ({bad[:2]}); expected {new_tokens} tokens each")
    s = pipe.last_stats
    return Run(ttft_s=s["ttft_s"], decode_s=s["decode_s"], decode_tokens=s["decode_tokens"],
               token_ids=[c.token_ids for c in completions])


def weight_bytes_per_step(cfg: ModelConfig, batch: int, elem: int, ckpt: Checkpoint | None = None) -> int:
    """Weight bytes one decode step must read, from the tensor table (any architecture): each
    layer's matrices and biases (only the experts a token picks, :func:`shapes.decode_read_params`)
    and norms, the final norm, the LM head, and ``batch`` rows of the embedding. For a GGUF file,
    whose matrices stay in their blocks, the file's own tensor bytes (the embedding, read whole when
    it is the tied LM head) and ``batch`` embedding rows of ``elem`` bytes."""
    from stagewise.model import shapes
    from stagewise.model.loader.gguf_file import GGUFCheckpoint

    if isinstance(ckpt, GGUFCheckpoint):
        return ckpt.tensor_bytes() + batch * cfg.hidden_size * elem
    layers = sum(shapes.decode_read_params(cfg, i)
                 + shapes.count(cfg, [t for t in shapes.layer_tensors(cfg, i) if t.kind == "norm"])
                 for i in range(cfg.num_layers))
    head = shapes.count(cfg, shapes.final_norm_tensors(cfg)) + cfg.vocab_size * cfg.hidden_size
    return (layers + head + batch * cfg.hidden_size) * elem


def kv_bytes_per_token(cfg: ModelConfig, elem: int) -> int:
    """K and V of one token in every layer."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem


def memory_floor(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int, elem: int, gbps: float,
                 ckpt: Checkpoint | None = None) -> dict:
    """The least time the decode (new_tokens - 1 steps) could take at ``gbps``: each step reads
    every weight once and each row's cached K/V (prompt_len + s - 1 tokens at step s), and writes
    one new token's K/V per row."""
    steps = new_tokens - 1
    weights = weight_bytes_per_step(cfg, batch, elem, ckpt)
    kv_tok = kv_bytes_per_token(cfg, elem)
    kv_total = sum(batch * (prompt_len + s - 1 + 1) * kv_tok for s in range(1, steps + 1))
    total = steps * weights + kv_total
    floor_s = total / (gbps * 1e9)
    return {"weight_bytes_per_step": weights, "kv_bytes_per_step_mean": kv_total / max(steps, 1),
            "bytes_per_step_mean": total / max(steps, 1), "floor_step_ms": 1e3 * floor_s / max(steps, 1),
            "floor_tokens_per_s": batch * steps / floor_s if floor_s > 0 else None}


def summarise(runs: list[Run]) -> dict:
    return {"ttft_ms": 1e3 * statistics.median(r.ttft_s for r in runs),
            "decode_tokens_per_s": statistics.median(r.decode_tokens / r.decode_s for r in runs),
            "decode_step_ms": 1e3 * statistics.median(r.decode_s / (r.decode_tokens / len(r.token_ids))
                                                      for r in runs),
            "runs": len(runs)}


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def bench_batch(pipes: dict, baselines: dict, ckpt: Checkpoint, batch: int, prompt_len: int, new_tokens: int,
                repeats: int, gbps: float, log=print, image: tuple[int, int] | None = None) -> list[dict]:
    """Result rows at one batch size, one per linear precision in ``pipes`` (precision ->
    Pipeline), each against the same runs of every baseline; all take turns. ``image`` (width,
    height): every row's prompt starts with such an image (:mod:`stagewise.bench.e2e.images`)."""
    prompts, images = make_prompts(ckpt, batch, prompt_len), None
    if image is not None:
        from stagewise.bench.e2e.images import image_prompts

        prompts, images = image_prompts(ckpt, prompts, image)
        for base in baselines.values():
            if not hasattr(base, "images"):
                raise ValueError(f"bench e2e: the {base.name} baseline takes no images")
            base.images = images
    prompt_len = len(prompts[0])
    for runner in (*pipes.values(), *baselines.values()):  # warm-up: allocator, first-call costs, page faults
        (run_ours(runner, prompts, 2, images) if runner in pipes.values() else runner.run(prompts, 2))
    ours: dict[str, list[Run]] = {mode: [] for mode in pipes}
    theirs: dict[str, list[Run]] = {name: [] for name in baselines}
    for i in range(repeats):
        for mode, pipe in pipes.items():
            ours[mode].append(run_ours(pipe, prompts, new_tokens, images))
        for name, base in baselines.items():
            theirs[name].append(base.run(prompts, new_tokens))
        rates = [f"ours {m} {r[-1].decode_tokens / r[-1].decode_s:.1f}" for m, r in ours.items()]
        rates += [f"{n} {r[-1].decode_tokens / r[-1].decode_s:.1f}" for n, r in theirs.items()]
        log(f"  batch {batch} run {i + 1}/{repeats}: {', '.join(rates)} tok/s")
    rows = []
    for mode, pipe in pipes.items():
        o = summarise(ours[mode])
        row = {"batch": batch, "linear_precision": mode, "prompt_len": prompt_len, "new_tokens": new_tokens,
               **({"image": f"{image[0]}x{image[1]}", "image_tokens": int(images.image_grid_thw.prod())
                                                           // ckpt.config.vision_config.spatial_merge_size**2}
                  if image else {}),
               "ours": o, "baselines": {}, "floor": memory_floor(ckpt.config, batch, prompt_len, new_tokens,
                                                                  pipe.dtype.itemsize, gbps, ckpt)}
        best = row["floor"]["floor_tokens_per_s"]
        row["ours_pct_floor"] = 100 * o["decode_tokens_per_s"] / best if best else None
        for name, runs in theirs.items():
            t = summarise(runs)
            # Greedy rows identical to the baseline's (float32 rounding may let long continuations
            # drift apart; the int8 mode changes the maths), and the mean length of the shared start.
            pairs = list(zip(ours[mode][-1].token_ids, runs[-1].token_ids))
            row["baselines"][name] = {
                **t, "decode_speedup": o["decode_tokens_per_s"] / t["decode_tokens_per_s"],
                "ttft_speedup": t["ttft_ms"] / o["ttft_ms"], "pct_floor": 100 * t["decode_tokens_per_s"] / best if best else None,
                "rows_matching": sum(a == b for a, b in pairs),
                "mean_common_prefix": statistics.mean(common_prefix(a, b) for a, b in pairs)}
        rows.append(row)
    return rows


QUESTIONS = ["What is the capital of France?", "Write one sentence about the sea.",
             "List three colours of the rainbow, separated by commas, and nothing else.", "Who wrote Hamlet?",
             "What is 12 times 12?", "Give me a short tip for learning to cook.",
             "Explain in one sentence what a lighthouse does.", "Translate 'good morning' into Spanish."]
AGREEMENT_TOKENS = (8, 24)


def agreement(pipes: dict, reference, max_len: int, new_tokens: int = AGREEMENT_TOKENS[-1]) -> dict:
    """Greedy tokens of each of ``pipes`` against ``reference`` (a baseline) on the chat QUESTIONS
    (one at a time, EOS ignored): the share of questions whose first n tokens are identical, for
    each n in AGREEMENT_TOKENS, and the mean length of the shared start. Questions longer than
    ``max_len`` with their answer are left out."""
    any_pipe = next(iter(pipes.values()))
    try:
        prompts = [any_pipe._encode([q], None, chat=True)[0] for q in QUESTIONS]
    except (ValueError, FileNotFoundError):  # no tokenizer or no chat template: nothing to ask
        return {}
    prompts = [p for p in prompts if len(p) + new_tokens <= max_len]
    if not prompts:
        return {}
    theirs = [reference.run([p], new_tokens).token_ids[0] for p in prompts]
    out = {}
    for mode, pipe in pipes.items():
        ours = [c.token_ids for c in pipe.generate(prompt_token_ids=prompts, max_new_tokens=new_tokens, ignore_eos=True)]
        prefixes = [common_prefix(a, b) for a, b in zip(ours, theirs)]
        out[mode] = {"questions": len(prompts), "mean_common_prefix": statistics.mean(prefixes),
                     **{f"first_{n}_equal": sum(p >= n for p in prefixes) for n in AGREEMENT_TOKENS}}
    return out


def run(args, log=print) -> int:
    """The `stagewise bench e2e` command: measure, print the table, write <device>-e2e.json/.md."""
    import os
    import sys

    from stagewise.api import Pipeline
    from stagewise.bench import report
    from stagewise.bench.e2e import images
    from stagewise.bench.e2e import report as results
    from stagewise.bench.e2e import startup as fresh
    from stagewise.measure.timing import TimingPolicy, copy_bandwidth
    from stagewise.model.loader import open_checkpoint

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    repeats = args.repeats or 3
    names = [b.strip() for b in str(args.baseline).split(",") if b.strip()]
    if not sizes or min(sizes) < 1 or args.prompt_len < 1 or args.new_tokens < 2 or repeats < 1 \
            or not names or any(b not in BASELINES for b in names):
        print(f"stagewise bench e2e: need batch sizes >= 1, --prompt-len >= 1, --new-tokens >= 2, --repeats >= 1 and "
              f"--baseline among {','.join(BASELINES)}; got {args.batch_sizes!r}, {args.prompt_len}, {args.new_tokens}, "
              f"{repeats}, {args.baseline!r}", file=sys.stderr)
        return 2
    info = report.machine_info(device)
    load_start = os.getloadavg()  # the machine may be shared: its load goes beside the figures
    policy = TimingPolicy(warmup=2, min_repeats=3, max_repeats=20, budget_s=0.5)
    copy_bytes = 2**24 if args.tiny else 2**30 if device == "cuda" else 2**28  # far beyond the caches
    copy_bw = copy_bandwidth(device, copy_bytes, policy)
    log(f"{info['device_name']}: copy bandwidth {copy_bw['gbps']:.1f} GB/s, {torch.get_num_threads()} torch threads; "
        f"{report.isa_line(info)}")
    image = None
    try:
        ckpt = open_checkpoint(args.model)
        if args.image:
            image = _size(args.image)
            extra = len(images.image_prompts(ckpt, [[]], image)[0][0])  # the image's tokens in each prompt
    except (FileNotFoundError, ValueError) as err:
        print(f"stagewise bench e2e: {err}", file=sys.stderr)
        return 2
    max_len = args.prompt_len + (extra if image else 0) + args.new_tokens + 1
    asked = [m.strip() for m in str(args.linear_precision).split(",") if m.strip()]
    if not asked or any(m not in ("exact", "int8") for m in asked):
        print(f"stagewise bench e2e: --linear-precision takes exact and/or int8, got {args.linear_precision!r}",
              file=sys.stderr)
        return 2
    per_row = -(-max_len // 64) * 64  # whole KV blocks for every row (any block size dividing 64)
    pipes, skipped = {}, []
    for mode in asked:
        try:
            pipes[mode] = Pipeline(ckpt, device=device, dtype=args.dtype, max_num_seqs=max(sizes), max_model_len=max_len,
                                   max_num_tokens=max(sizes) * per_row, linear_precision=mode)
        except (ValueError, NotImplementedError) as err:  # int8: the CPU, float32
            log(f"bench e2e: skipping linear precision {mode}: {err}")
            skipped.append(mode)
    if not pipes:
        print(f"stagewise bench e2e: no linear precision could run ({asked})", file=sys.stderr)
        return 2
    try:
        baselines = {n: open_baseline(n, ckpt, device=device, threads=torch.get_num_threads(), max_seqs=max(sizes),
                                      max_len=max_len, install=args.install_baseline, dtype=getattr(torch, args.dtype),
                                      log=log) for n in names}
    except (ImportError, ValueError) as err:
        print(f"stagewise bench e2e: {err}", file=sys.stderr)
        return 2
    rows = [row for b in sizes for row in bench_batch(pipes, baselines, ckpt, b, args.prompt_len, args.new_tokens,
                                                       repeats, copy_bw["gbps"], log, image)]
    for base in baselines.values():  # the agreement questions are text only
        if hasattr(base, "images"):
            base.images = None
    agree = {name: agreement(pipes, base, max_len) for name, base in baselines.items()}
    startup = {}
    if args.startup and not args.tiny:
        ids = next(iter(pipes.values()))._encode([fresh.PROMPT], None, chat=True)[0]
        startup = fresh.measure(str(args.model), torch.get_num_threads(), repeats,
                                      llama_cpp_path=str(ckpt.path) if "llama.cpp" in baselines else None,
                                      prompt_ids=ids, log=log)
    for base in baselines.values():
        base.close()
    info.update(model=str(args.model), dtype=args.dtype, repeats=repeats, linear_precisions=list(pipes),
                skipped_precisions=skipped, baselines={n: b.info for n, b in baselines.items()},
                load_average={"start": list(load_start), "end": list(os.getloadavg())})
    print(results.format_table(rows))
    stem = results.write(args.out, info, copy_bw, rows, agree, startup)
    log(f"wrote {stem}.json and {stem}.md")
    return 0


def _size(text: str) -> tuple[int, int]:
    """``WxH`` -> (width, height)."""
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--image takes WIDTHxHEIGHT in pixels, e.g. 448x448; got {text!r}") from None
    if w < 1 or h < 1:
        raise ValueError(f"--image takes a positive size, got {text!r}")
    return w, h

"""`stagewise bench e2e --launcher ray [--stages S]`: the same pipeline started by the local
launcher and by the Ray launcher, side by side in one run.

For each launcher: start-up to the first token (a new Pipeline of S stages, then one token of one
prompt), and decode TPOT and tokens/s at batch 1 and batch 8; the launchers take turns for every
measurement, so a noisy machine slows both alike. The Ray instance (the cluster at
``RAY_ADDRESS``, else one started here) is up before any timing: a cluster exists before its
jobs, and starting a local instance is timed apart. Greedy tokens of both must be identical.
Target: Ray's TPOT within 5 % of local spawn.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

BATCHES = (1, 8)


def run(args, log=print) -> int:
    from stagewise.api import Pipeline
    from stagewise.bench import report
    from stagewise.bench.e2e.prompts import make_prompts
    from stagewise.launch.ray_cluster import import_ray

    stages = int(str(args.stages or "3").split(",")[-1])
    repeats = args.repeats or 3
    if stages < 2 or args.prompt_len < 1 or args.new_tokens < 2 or repeats < 1:
        print("stagewise bench e2e --launcher ray: --stages S >= 2 (one count), --prompt-len >= 1, "
              "--new-tokens >= 2, --repeats >= 1", file=sys.stderr)
        return 2
    ray = import_ray()
    torch.set_num_threads(1)
    start = time.perf_counter()
    joined = ray.is_initialized()
    if not joined:
        from stagewise.launch.ray_cluster import connect

        connect(ray, None, cpus=stages)
    ray_start_s = time.perf_counter() - start
    info = report.machine_info("cpu")
    max_len = args.prompt_len + args.new_tokens + 1
    options = dict(stages=stages, threads=1, dtype="float32", max_num_seqs=max(BATCHES), max_model_len=max_len)
    launchers = ("local", "ray")
    samples: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    try:
        prompts = None
        for rep in range(repeats):
            for launcher in launchers:
                kw = {"launcher": "ray"} if launcher == "ray" else {}
                t0 = time.perf_counter()
                with Pipeline(args.model, **options, **kw) as pipe:
                    if prompts is None:
                        prompts = {b: make_prompts(pipe.checkpoint, b, args.prompt_len) for b in BATCHES}
                    pipe.generate(prompt_token_ids=prompts[1], max_new_tokens=1, ignore_eos=True)
                    samples.setdefault((launcher, "startup_s"), []).append(time.perf_counter() - t0)
                    for b in BATCHES:
                        out = pipe.generate(prompt_token_ids=prompts[b], max_new_tokens=args.new_tokens,
                                            ignore_eos=True)
                        st = pipe.last_stats
                        steps = st["decode_tokens"] / b
                        samples.setdefault((launcher, f"tpot_s_b{b}"), []).append(st["decode_s"] / steps)
                        samples.setdefault((launcher, f"tok_s_b{b}"), []).append(st["decode_tokens_per_s"])
                        tokens[(launcher, b)] = [c.token_ids for c in out]
                log(f"  run {rep + 1}/{repeats} {launcher}: start-up {samples[(launcher, 'startup_s')][-1]:.2f} s, "
                    + ", ".join(f"batch {b} TPOT {1e3 * samples[(launcher, f'tpot_s_b{b}')][-1]:.1f} ms"
                                for b in BATCHES))
    finally:
        if not joined and ray.is_initialized():
            ray.shutdown()
    med = {k: statistics.median(v) for k, v in samples.items()}
    rows = []
    for launcher in launchers:
        row = {"launcher": launcher, "startup_s": med[(launcher, "startup_s")]}
        for b in BATCHES:
            row[f"tpot_ms_b{b}"] = 1e3 * med[(launcher, f"tpot_s_b{b}")]
            row[f"tok_s_b{b}"] = med[(launcher, f"tok_s_b{b}")]
            row[f"tpot_vs_local_b{b}"] = med[(launcher, f"tpot_s_b{b}")] / med[("local", f"tpot_s_b{b}")]
            row[f"tokens_equal_b{b}"] = tokens[(launcher, b)] == tokens[("local", b)]
        rows.append(row)
    info.update(model=str(args.model), stages=stages, repeats=repeats, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, ray_version=ray.__version__,
                ray_instance="joined" if joined else f"started here in {ray_start_s:.2f} s (not in start-up)")
    table = format_table(rows)
    print(table)
    report.write_results(args.out, f"{info['device']}-e2e-launchers", {"machine": info, "rows": rows}, [
        f"# stagewise end to end: {stages} stages started locally and on Ray", "",
        f"Machine: {info['device_name']} ({info['device']}), {info['cpu_count']} CPUs; 1 torch thread per stage; "
        f"torch {info['torch']}; Ray {ray.__version__}, instance {info['ray_instance']}  ",
        f"Date (UTC): {info['date_utc']}; commit: {info['git_commit']}  ",
        f"Model: {info['model']}, float32, greedy, EOS ignored, prompt {args.prompt_len}, {args.new_tokens} new "
        f"tokens; median of {repeats} runs, the launchers taking turns", "",
        "start-up = a new Pipeline of the stages to its first token of one prompt. TPOT ratio = this launcher's "
        "over local spawn's in the same run (target for Ray: <= 1.05). tokens = local: greedy tokens identical.", "",
        table, ""], log)
    return 0


def format_table(rows: list[dict]) -> str:
    head = ["launcher", "start-up s"] + [f"{what} b{b}" for b in BATCHES
                                         for what in ("TPOT ms", "tok/s", "TPOT ratio", "tokens = local")]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [r["launcher"], f"{r['startup_s']:.2f}"]
        for b in BATCHES:
            cells += [f"{r[f'tpot_ms_b{b}']:.2f}", f"{r[f'tok_s_b{b}']:.1f}", f"{r[f'tpot_vs_local_b{b}']:.3f}",
                      "yes" if r[f"tokens_equal_b{b}"] else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

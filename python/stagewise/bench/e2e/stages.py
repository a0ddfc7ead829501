"""`stagewise bench e2e --stages 1,2,3`: SmolLM2 decode through the pipeline's stage processes.

For every stage count S it measures, side by side in one run (the configurations take turns,
so a noisy machine slows them alike):

- batch 1: decode tokens/s and time per output token; the per-token overhead of S stages over
  the single process (target: S = 2 at most 10 % slower than S = 1);
- S x 4 concurrent requests: decode tokens/s and each stage's busy fraction (compute time over
  the stage's wall time during the call; target: every stage >= 80 % busy).

Greedy tokens of every S are compared with S = 1 (they must be identical). Every stage runs
one torch thread, the single process as well. For S > 1 the batch-1 runs also say where a decode
token's time goes (:mod:`stagewise.pipeline.timeline`, from the stages' own spans): each stage's
compute, and each hop's encoding, sending, waking and decoding; and, measured in the same turns,
the floor under the overhead (:mod:`stagewise.bench.e2e.handoff`): each S's stage layers taking
turns in S bare processes against the same layers in one.
"""

from __future__ import annotations

import statistics
import sys

import torch


def run(args, log=print) -> int:
    from stagewise.api import Pipeline
    from stagewise.bench import report
    from stagewise.bench.e2e.handoff import Handoff
    from stagewise.bench.e2e.prompts import make_prompts
    from stagewise.pipeline.timeline import format_segments, median_timeline, token_segments

    try:
        counts = [int(s) for s in str(args.stages).split(",") if s.strip()]
    except ValueError:
        counts = []
    repeats = args.repeats or 3
    if not counts or min(counts) < 1 or args.prompt_len < 1 or args.new_tokens < 2 or repeats < 1:
        print(f"stagewise bench e2e: --stages takes stage counts >= 1 such as 1,2,3 (got {args.stages!r}); "
              "--prompt-len >= 1, --new-tokens >= 2, --repeats >= 1", file=sys.stderr)
        return 2
    counts = sorted(set(counts) | {1})
    torch.set_num_threads(1)
    transport = getattr(args, "transport", None) or "auto"
    partition = getattr(args, "partition", None) or "balanced"
    info = report.machine_info("cpu")
    max_len = args.prompt_len + args.new_tokens + 1
    most = 4 * max(counts)
    pipes, bare = {}, {}
    try:
        for s in counts:
            log(f"starting S={s} ...")
            options = {} if s == 1 else {"threads": 1, "transport": transport, "partition": partition}
            pipes[s] = Pipeline(args.model, stages=s, dtype="float32", max_num_seqs=most, max_model_len=max_len,
                                max_num_tokens=most * max_len, **options)
        for s in counts[1:]:
            plan = pipes[s].driver.plan
            bare[s] = Handoff(args.model, [(st.start_layer, st.end_layer) for st in plan.stages], dtype=plan.dtype,
                              quantized=plan.quantized, precision=plan.linear_precision, max_len=max_len)
        ckpt = pipes[1].checkpoint
        cases = {"b1": make_prompts(ckpt, 1, args.prompt_len)}
        for s in counts:
            cases[f"c{s}"] = make_prompts(ckpt, 4 * s, args.prompt_len)
        samples: dict[tuple[int, str], list[dict]] = {}
        floors: dict[tuple[int, str], list[dict]] = {}
        timelines: dict[int, list] = {}
        tokens: dict[tuple[int, str], list[list[int]]] = {}
        for s, pipe in pipes.items():  # warm-up
            pipe.generate(prompt_token_ids=cases["b1"], max_new_tokens=2, ignore_eos=True)
        for rep in range(repeats):
            for s, pipe in pipes.items():
                for case in ("b1", f"c{s}"):
                    prompts = cases[case]
                    prefill = None
                    if s > 1:  # the prefill alone, to take it off the stages' busy and wall time
                        pipe.generate(prompt_token_ids=prompts, max_new_tokens=1, ignore_eos=True)
                        prefill = pipe.last_stats["stages"]
                    out = pipe.generate(prompt_token_ids=prompts, max_new_tokens=args.new_tokens, ignore_eos=True)
                    st = dict(pipe.last_stats)
                    if prefill is not None:
                        st["decode_busy"] = [(a["busy_s"] - b["busy_s"]) / max(a["wall_s"] - b["wall_s"], 1e-9)
                                             for a, b in zip(st["stages"], prefill)]
                    steps = st["decode_tokens"] / len(prompts)
                    st["tpot_s"] = st["decode_s"] / steps if steps else 0.0
                    samples.setdefault((s, case), []).append(st)
                    tokens[(s, case)] = [c.token_ids for c in out]
                    if s > 1 and case == "b1":
                        timelines.setdefault(s, []).append(token_segments(pipe.stage_stats(trace=True)))
                    log(f"  run {rep + 1}/{repeats} S={s} {case}: {st['decode_tokens_per_s']:.1f} tok/s, "
                        f"TPOT {1e3 * st['tpot_s']:.1f} ms")
                if s in bare:
                    for mode in BARE_MODES:
                        floors.setdefault((s, mode), []).append(bare[s].run(
                            cases["b1"][0], args.new_tokens, processes=mode != "one", spin=mode == "spin"))
    finally:
        for closable in [*pipes.values(), *bare.values()]:
            closable.close()
    rows = []
    base_tpot = statistics.median(r["tpot_s"] for r in samples[(1, "b1")])
    for s in counts:
        for case in ("b1", f"c{s}"):
            runs = samples[(s, case)]
            row = {"stages": s, "requests": len(cases[case]),
                   "decode_tok_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
                   "tpot_ms": 1e3 * statistics.median(r["tpot_s"] for r in runs),
                   "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in runs),
                   "tokens_equal_s1": tokens[(s, case)] == tokens[(1, case)] if (1, case) in tokens else None}
            if case == "b1":
                row["overhead_vs_s1_pct"] = 100.0 * (1e-3 * row["tpot_ms"] / base_tpot - 1.0)
            if case == "b1" and s > 1:
                ms = {m: 1e3 * statistics.median(r["mean_s"] for r in floors[(s, m)]) for m in BARE_MODES}
                row.update({f"bare_{m}_ms": v for m, v in ms.items()},
                           bare_overhead_pct=100.0 * (min(ms["sleep"], ms["spin"]) / ms["one"] - 1.0),
                           bare_tokens_equal=all(r["tokens"] == tokens[(1, "b1")][0]
                                                 for m in BARE_MODES for r in floors[(s, m)]))
            if s > 1:
                row["busy_pct"] = [100.0 * statistics.median(r["stages"][i]["busy_fraction"] for r in runs)
                                   for i in range(s)]
                row["decode_busy_pct"] = [100.0 * statistics.median(r["decode_busy"][i] for r in runs)
                                          for i in range(s)]
                row["layers"] = [r["layers"] for r in runs[0]["stages"]]
            rows.append(row)
    info.update(model=str(args.model), dtype="float32", repeats=repeats, transport=transport, partition=partition,
                prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    table = format_table(rows)
    print(table)
    floor = format_floor(rows)
    print(floor)
    segments = format_segments({s: median_timeline(t) for s, t in timelines.items()}, 1e3 * rows[0]["tpot_ms"])
    print(segments)
    for s, t in timelines.items():
        median = median_timeline(t)
        rows[[r["stages"] for r in rows].index(s)].update(timeline_us=dict(median.segments),
                                                          timeline_cycle_us=median.cycle_us)
    report.write_results(args.out, f"{info['device']}-e2e-stages", {"machine": info, "rows": rows}, [
        "# stagewise pipeline end to end: SmolLM2 decode by stage count", "",
        f"Machine: {info['device_name']} ({info['device']}), {info['cpu_count']} CPUs; 1 torch thread per stage "
        f"(and for S = 1); torch {info['torch']}  ", f"Date (UTC): {info['date_utc']}; commit: {info['git_commit']}  ",
        f"Model: {info['model']}, float32, greedy, EOS ignored, prompt {args.prompt_len}, {args.new_tokens} new tokens; "
        f"transport {transport}, partition {partition}; median of {repeats} runs, configurations taking turns", "",
        "overhead = TPOT at batch 1 over S = 1's, in % (targets: S = 2 <= 3 %, S = 3 <= 5 %). busy % = each "
        "stage's compute time over its wall time during the whole call; decode busy % = the same after the "
        "prefill (a prefill-only call of the same prompts taken off), with S x 4 concurrent requests the targets "
        "are >= 90 % (S = 2) and >= 85 % (S = 3). S stage processes and the driver share this machine's "
        f"{info['cpu_count']} cores. "
        "tokens = S1: greedy tokens identical to the single process.", "",
        table, "", "The floor under the batch-1 overhead (stagewise/bench/e2e/handoff.py): each S's stage layers "
        "taking turns in S bare processes, a pipe between them and no pipeline code, each waiting asleep on its "
        "pipe or polling it, against the same layers taking turns in one process; mean decode cycle, median of "
        "the runs, measured in the same turns as the pipelines. What the pipeline adds above the better of the "
        "two is its own:", "", floor, "", "Where a batch-1 decode token's time goes (median over the tokens of a run, then over the runs; "
        "the segments are consecutive and add up to the cycle, see stagewise/pipeline/timeline.py):", "",
        segments, ""], log)
    return 0


BARE_MODES = ("one", "sleep", "spin")
"""The bare layers in one process; in S processes, each waiting asleep on its pipe; each polling."""


def format_floor(rows: list[dict]) -> str:
    lines = ["| S | pipeline overhead % | bare: one process ms | S processes, asleep ms | S processes, polling ms | "
             "floor % (the better) | pipeline above the floor, points | bare tokens = S1 |", "|" + "---:|" * 8]
    for r in rows:
        if "bare_overhead_pct" in r:
            lines.append(f"| {r['stages']} | {r['overhead_vs_s1_pct']:+.1f} | {r['bare_one_ms']:.2f} | "
                         f"{r['bare_sleep_ms']:.2f} | {r['bare_spin_ms']:.2f} | {r['bare_overhead_pct']:+.1f} | "
                         f"{r['overhead_vs_s1_pct'] - r['bare_overhead_pct']:+.1f} | "
                         f"{'yes' if r['bare_tokens_equal'] else 'NO'} |")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    head = ["S", "requests", "decode tok/s", "TPOT ms", "TTFT ms", "overhead %", "busy % per stage",
            "decode busy % per stage", "tokens = S1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        busy = " / ".join(f"{b:.0f}" for b in r.get("busy_pct", [])) or "-"
        dbusy = " / ".join(f"{b:.0f}" for b in r.get("decode_busy_pct", [])) or "-"
        over = f"{r['overhead_vs_s1_pct']:+.1f}" if "overhead_vs_s1_pct" in r else "-"
        eq = "-" if r["tokens_equal_s1"] is None else ("yes" if r["tokens_equal_s1"] else "NO")
        lines.append(f"| {r['stages']} | {r['requests']} | {r['decode_tok_s']:.1f} | {r['tpot_ms']:.1f} | "
                     f"{r['ttft_ms']:.0f} | {over} | {busy} | {dbusy} | {eq} |")
    return "\n".join(lines)

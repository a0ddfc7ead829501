"""`stagewise bench e2e --tp 1,3 [--dcp 1,3]`: decode with a stage split over tensor-parallel
(and decode-context-parallel) ranks, side by side with tp = 1 in the same run.

For every layout (one stage of ``tp`` ranks, ``dcp`` of them sharding each KV head's sequence) it
measures at batch 1 and at batch ``max(--batch-sizes)``: decode tokens/s and time per output
token; from the stage leader's counters during the decode, the time in collectives per step and
its share of the step, and the time handing each step to the other ranks (the fan-out); each
rank's KV bytes. The single process (tp = 1) is the baseline. Greedy tokens of every layout are
compared with it. Every rank runs one torch thread (so does the single process): on a machine
with fewer cores than ranks the ranks share cores, which the results file says.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch


def _sizes(text, name: str) -> list[int]:
    try:
        out = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"--{name} takes sizes >= 1 such as 1,3 (got {text!r})")
    return out


def layouts(tp_text, dcp_text) -> list[tuple[int, int]]:
    """(tp, dcp) pairs to run: every tp with every dcp that divides it, and (1, 1) first."""
    tps, dcps = _sizes(tp_text, "tp"), _sizes(dcp_text or "1", "dcp")
    out = [(1, 1)] + [(t, d) for t in sorted(set(tps)) for d in sorted(set(dcps)) if t % d == 0 and (t, d) != (1, 1)]
    return out


def run(args, log=print) -> int:
    from stagewise.api import Pipeline
    from stagewise.bench import report
    from stagewise.bench.e2e.prompts import make_prompts

    try:
        pairs = layouts(args.tp, args.dcp)
    except ValueError as err:
        print(f"stagewise bench e2e: {err}", file=sys.stderr)
        return 2
    repeats = args.repeats or 3
    batch = max(int(b) for b in str(args.batch_sizes).split(",") if b.strip())
    torch.set_num_threads(1)
    info = report.machine_info("cpu")
    model_name, model_note = str(args.model), ""
    if getattr(args, "heads", None):
        from stagewise.bench.regroup import regrouped_model

        model_name = f"{args.model} --heads {args.heads}"
        args.model, model_note = regrouped_model(args.model, args.heads, log=log)
    from stagewise.model.loader import open_checkpoint
    from stagewise.model.shapes import parallel_problems

    config = open_checkpoint(args.model).config
    for tp, dcp in list(pairs):
        why = parallel_problems(config, tp, dcp)
        if why:
            log(f"skipping tp={tp} dcp={dcp}: {why[0]}")
            pairs.remove((tp, dcp))
    if len(pairs) < 2:
        print("stagewise bench e2e: no --tp/--dcp layout beside tp=1 that the model's heads allow (see above; "
              "--heads Q/KV regroups a GGUF model)", file=sys.stderr)
        return 2
    max_len = args.prompt_len + args.new_tokens + 1
    pipes = {}
    try:
        for tp, dcp in pairs:
            log(f"starting tp={tp} dcp={dcp} ...")
            options = {} if tp == 1 else {"threads": 1, "interleave_size": 1}
            pipes[(tp, dcp)] = Pipeline(args.model, tp=tp, dcp=dcp, dtype="float32", max_num_seqs=batch,
                                        max_model_len=max_len, max_num_tokens=batch * max_len, **options)
        ckpt = pipes[(1, 1)].checkpoint
        cases = {"b1": make_prompts(ckpt, 1, args.prompt_len), f"b{batch}": make_prompts(ckpt, batch, args.prompt_len)}
        samples: dict[tuple, list[dict]] = {}
        tokens: dict[tuple, list[list[int]]] = {}
        for pipe in pipes.values():  # warm-up
            pipe.generate(prompt_token_ids=cases["b1"], max_new_tokens=2, ignore_eos=True)
        for rep in range(repeats):
            for key, pipe in pipes.items():
                for case, prompts in cases.items():
                    prefill = None
                    if key != (1, 1):  # the prefill alone, to take it off the leader's counters
                        pipe.generate(prompt_token_ids=prompts, max_new_tokens=1, ignore_eos=True)
                        prefill = pipe.last_stats["stages"][0]
                    out = pipe.generate(prompt_token_ids=prompts, max_new_tokens=args.new_tokens, ignore_eos=True)
                    st = dict(pipe.last_stats)
                    steps = st["decode_tokens"] / len(prompts)
                    st["tpot_s"] = st["decode_s"] / steps if steps else 0.0
                    if prefill is not None:
                        full = st["stages"][0]
                        n = max(full["steps"] - prefill["steps"], 1)
                        st["collective_ms"] = 1e3 * (full["collective_s"] - prefill["collective_s"]) / n
                        st["fanout_ms"] = 1e3 * (full["fanout_s"] - prefill["fanout_s"]) / n
                        st["step_ms"] = 1e3 * (full["busy_s"] - prefill["busy_s"]) / n
                        st["collective_kb"] = (full["collective_bytes"] - prefill["collective_bytes"]) / n / 1e3
                        st["kv_mb"] = full["kv_blocks"] * full["kv_block_bytes"] / 1e6
                    samples.setdefault((key, case), []).append(st)
                    tokens[(key, case)] = [c.token_ids for c in out]
                    log(f"  run {rep + 1}/{repeats} tp={key[0]} dcp={key[1]} {case}: "
                        f"{st['decode_tokens_per_s']:.1f} tok/s, TPOT {1e3 * st['tpot_s']:.1f} ms")
        kv_single = _kv_bytes(pipes[(1, 1)]) / 1e6
    finally:
        for pipe in pipes.values():
            pipe.close()
    rows = []
    for key in pipes:
        for case in cases:
            runs = samples[(key, case)]
            med = (lambda name: statistics.median(r[name] for r in runs))
            row = {"tp": key[0], "dcp": key[1], "requests": len(cases[case]),
                   "decode_tok_s": med("decode_tokens_per_s"), "tpot_ms": 1e3 * med("tpot_s"),
                   "tokens_equal_tp1": tokens[(key, case)] == tokens[((1, 1), case)]}
            base = statistics.median(r["decode_tokens_per_s"] for r in samples[((1, 1), case)])
            row["x_tp1"] = row["decode_tok_s"] / base if base else 0.0
            if key == (1, 1):
                row["kv_mb_per_rank"] = kv_single
            else:
                for name in ("collective_ms", "fanout_ms", "step_ms", "collective_kb", "kv_mb"):
                    row[name] = med(name)
                row["kv_mb_per_rank"] = row.pop("kv_mb")
                row["collective_pct"] = 100.0 * row["collective_ms"] / row["step_ms"] if row["step_ms"] else 0.0
            rows.append(row)
    info.update(model=model_name, model_note=model_note, dtype="float32", repeats=repeats, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, cpu_count=os.cpu_count())
    table = format_table(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    tps, dcps = sorted({t for t, _ in pairs}), sorted({d for _, d in pairs})
    stem = args.out / (f"{info['device']}-e2e-parallel-tp{'-'.join(map(str, tps))}"
                       + (f"-dcp{'-'.join(map(str, dcps))}" if dcps != [1] else ""))
    stem.with_suffix(".json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2) + "\n")
    stem.with_suffix(".md").write_text("\n".join([
        "# stagewise tensor and decode context parallel end to end: decode by layout", "",
        f"Machine: {info['device_name']} ({info['device']}), {info['cpu_count']} CPUs; 1 torch thread per rank "
        f"(and for tp = 1); torch {info['torch']}  ", f"Date (UTC): {info['date_utc']}; commit: {info['git_commit']}  ",
        f"Model: {info['model']}, float32, greedy, EOS ignored, prompt {args.prompt_len}, {args.new_tokens} new tokens; "
        f"one stage; median of {repeats} runs, layouts taking turns" + (f"  \n{model_note}" if model_note else ""), "",
        "x tp1 = decode tok/s over the single process's in the same run. collective ms / step = the stage leader's "
        "time inside its collectives (all-reduces, gathers; over shared memory between the CPU ranks of a host, NCCL on GPUs) per decode step, and its "
        "share of the leader's step; fan-out ms = its time handing the step to the other ranks; KB / step = bytes "
        "it handed to collectives per step; KV MB / rank = each rank's KV cache. "
        f"{info['cpu_count']} cores: with more ranks than cores the ranks time-share them, so tok/s here measures "
        "the overhead of splitting, not the speed-up of more hardware. One GPU on the lent machines: multi-GPU TP "
        "is not measured here.", "", table, ""]))
    log(f"wrote {stem}.json and {stem}.md")
    return 0


def _kv_bytes(pipe) -> float:
    return pipe._backend.engine.executor.kv_cache.nbytes


def format_table(rows: list[dict]) -> str:
    head = ["tp", "dcp", "requests", "decode tok/s", "x tp1", "TPOT ms", "collective ms / step", "collective %",
            "fan-out ms / step", "KB / step", "KV MB / rank", "tokens = tp1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        get = (lambda name, fmt: format(r[name], fmt) if name in r else "-")
        lines.append(f"| {r['tp']} | {r['dcp']} | {r['requests']} | {r['decode_tok_s']:.1f} | {r['x_tp1']:.2f} | "
                     f"{r['tpot_ms']:.1f} | {get('collective_ms', '.2f')} | {get('collective_pct', '.0f')} | "
                     f"{get('fanout_ms', '.2f')} | {get('collective_kb', '.1f')} | {r['kv_mb_per_rank']:.1f} | "
                     f"{'yes' if r['tokens_equal_tp1'] else 'NO'} |")
    return "\n".join(lines)

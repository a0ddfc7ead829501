"""``stagewise plan validate MODEL --stages 1 2 3``: run the real pipeline for each stage count and
batch, predict the same runs from a device profile, and compare (the planner's side is
:mod:`stagewise.planner.validate`). Results go to ``<out>/<device>-plan-validate.{json,md}`` (default
out: a new folder ``bench/results/<device>-<date>``) and, as the planner's latest validation, to
``planner/validation.json``. With ``--tiny`` (or ``STAGEWISE_BENCH_TINY=1``) it runs at toy sizes (16
prompt and 4 new tokens, one repeat unless given, the profile measured quickly) to check that the
command works, and keeps the planner's validation record as it is: toy numbers must not become the
planner's expected error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

from stagewise.bench import report, tiny_from_environment
from stagewise.bench.e2e import make_prompts
from stagewise.bench.profile_runtime import background_load, concurrent_pass_s
from stagewise.model.loader import open_checkpoint
from stagewise.parallel.ranks import ParallelConfig
from stagewise.planner import validate as val
from stagewise.planner.estimate import Workload, contention, estimate_layout
from stagewise.planner.profiles import load_profile, profile_from_dict
from stagewise.planner.validate import MeasuredRun


def main(argv: list[str]) -> int:
    try:
        return _run(argv)
    except (ValueError, FileNotFoundError) as err:
        print(f"stagewise plan validate: {err}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="stagewise plan validate",
                                description="Run the real pipeline and compare with the planner's prediction.")
    p.add_argument("model", help="a checkpoint stagewise can run (smollm2-135m, a folder, a .gguf)")
    p.add_argument("--stages", type=int, nargs="+", default=[1])
    p.add_argument("--transport", default=None, help="the runtime's transport between stages (e.g. tcp)")
    p.add_argument("--device-profile", default=None,
                   help="profile JSON (default: measure this machine now, in this process, just before the runs: "
                        "on a shared machine a stored profile may describe other conditions)")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes, each run at every stage count")
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--input-length", type=int, default=None, help="prompt tokens (default 128; --tiny: 16)")
    p.add_argument("--output-length", type=int, default=None, help="new tokens (default 32; --tiny: 4)")
    p.add_argument("--repeats", type=int, default=None, help="runs per configuration (default 3; --tiny: 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the profile is measured)")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for the results (default: a new folder bench/results/<device>-<date>)")
    p.add_argument("--no-store", action="store_true", help="do not update the planner's validation record")
    p.add_argument("--tiny", action="store_true",
                   help="toy sizes, to check that the command works; never stored as the validation record "
                        "(STAGEWISE_BENCH_TINY=1 does the same)")
    args = p.parse_args(argv)
    import torch

    log = (lambda line: print(line, file=sys.stderr, flush=True))
    args.tiny = args.tiny or tiny_from_environment(log)
    for name, full, tiny in (("input_length", 128, 16), ("output_length", 32, 4), ("repeats", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)

    if min(args.stages) < 1 or min(args.batch) < 1 or args.input_length < 1 or args.output_length < 2 or args.repeats < 1:
        raise ValueError("--stages, --batch, --input-length, --repeats must be >= 1 and --output-length >= 2")
    torch.set_num_threads(args.threads)
    info = report.machine_info("cpu")
    args.out = args.out if args.out is not None else report.default_out(info["device"])
    if args.device_profile:
        profile = load_profile(args.device_profile)
    else:
        from stagewise.bench.profile import measure_profile

        log("measuring this machine's profile now")
        profile = profile_from_dict(measure_profile("cpu", quick=args.tiny, log=log), "measured in the same run")
    profile = profile.with_transport(args.transport) if args.transport and args.transport in profile.transports \
        else profile
    ckpt = open_checkpoint(args.model)
    config = ckpt.config
    weight_quant, embed_quant = checkpoint_quant(ckpt)
    def workload(batch: int) -> Workload:
        return Workload(input_length=args.input_length, output_length=args.output_length, batch=batch,
                        microbatches=args.microbatches, weight_dtype="float32", kv_dtype="float32",
                        weight_quant=weight_quant, embed_quant=embed_quant)
    load_before = os.getloadavg()
    rows = []
    for B in args.batch:
        for S in args.stages:
            # Other work on the machine just before this configuration runs (0 off Linux), and how
            # fast its busy stage processes can run side by side now, against the profile's one.
            background = background_load() if profile.kind == "cpu" else None
            run_profile, n = profile, min(B, S)
            if profile.kind == "cpu" and profile.concurrency and n > 1:
                # n processes side by side against one, measured back to back now (the profile's
                # rates are those of one process alone: one is the reference, not a pace to rescale).
                conc = {str(k): concurrent_pass_s(k) for k in range(1, n + 1)}
                run_profile = dataclasses.replace(profile, concurrency=conc)
            est = estimate_layout(config, ParallelConfig(world_size=S, pp=S), workload(B), run_profile)
            slow = contention(run_profile, S, B if args.microbatches is None else args.microbatches)
            log(f"B={B} S={S}: background load {background if background is not None else 0:.2f}, {n} busy "
                f"process(es) now {slow:.2f}x the profile's pace; predicted TTFT {1e3 * est.ttft_s:.1f} ms, "
                f"TPOT {1e3 * est.tpot_s:.2f} ms; measuring ...")
            try:
                measured = measure(args.model, S, batch=B, input_length=args.input_length,
                                       output_length=args.output_length, transport=args.transport,
                                       repeats=args.repeats, log=log)
            except (NotImplementedError, ValueError, RuntimeError, TimeoutError) as err:
                raise ValueError(str(err)) from None
            rows += [{"batch": B, "background_load": background, "contention": slow, **r}
                     for r in val.compare(est, measured)]
    table = val.format_rows(rows)
    print(table)
    load_after = os.getloadavg()
    wl = {"batch": list(args.batch), "input_length": args.input_length, "output_length": args.output_length,
          "microbatches": args.microbatches, "dtype": "float32", "threads": args.threads,
          "weight_quant": weight_quant, "embed_quant": embed_quant}
    info = {**info, "load_average_before": list(load_before), "load_average_after": list(load_after)}
    data = val.summary(rows, model=args.model, architecture=config.architecture,
                       profile={"name": profile.name, "kind": profile.kind, "source": profile.source},
                       workload=wl, machine=info)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{info['device']}-plan-validate"
    stem.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    stem.with_suffix(".md").write_text("\n".join([
        "# Planner predictions against measured runs", "",
        f"Machine: {info['device_name']} ({info['device']}), {args.threads} torch thread(s); torch {info['torch']}  ",
        f"Date (UTC): {info['date_utc']}; commit: {info['git_commit']}  ",
        f"Model: {args.model}, float32 activations, {weight_quant or 'dense'} linears, {embed_quant or 'dense'} "
        f"embedding/LM head, batch {' and '.join(map(str, args.batch))}, prompt {args.input_length}, {args.output_length} new tokens; "
        f"median of {args.repeats} runs  ", f"Profile: {profile.name} ({profile.source})  ",
        f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; after: "
        f"{', '.join(f'{x:.2f}' for x in load_after)} (2-core machine, shared)", "",
        "Error = (predicted - measured) / measured; the bubble's error is in % of the measured TPOT.", "",
        table, "", VALIDATE_METHOD, ""]))
    log(f"wrote {stem}.json and {stem}.md")
    if args.tiny:
        log("toy sizes (--tiny): the planner's validation record stays as it is")
    elif not args.no_store:
        val.STORE.write_text(json.dumps(data, indent=2) + "\n")
        log(f"updated the planner's validation record {val.STORE}")
    return 0


VALIDATE_METHOD = """Method: the prediction comes from the device profile alone, i.e. primitive costs that
`stagewise bench profile` measures apart from any model run, each the median of several passes
spread over the measurement (the fixed per-step costs of the stage roles: the least disturbed of
five medians): the block-quantised linear per GGUF type (weights streamed from
memory) timed at 1, 2, 4 and 32 rows of x on two shapes of as many weights, which gives its cost per
weight and per output row at each row count (its register tiles make 2 rows cost as much as 4);
the decode attention kernel over paged caches streamed from memory, timed at three shapes, which
gives its cost per call, per FLOP and per cached K/V byte; the runtime's Python/dispatch cost per
decoder layer, measured on a synthetic llama (hidden 512, 24 layers, 45 MB of Q4_1 weights beyond
the caches) as the step's wall time minus its kernels' self time (torch profiler), since streaming
weights evict the interpreter's state (a negligible-width model, all in cache, gives less), and per
step of each stage role (negligible-width model); the one-way latency and bandwidth of the
pipeline's own shm/tcp links between two processes; matmul FLOP/s, copy bandwidth and the core
count. The planner adds the per-operator content of the model's stages (weights, output rows,
FLOPs, cached bytes) to the framework cost per stage, for each microbatch at the size the runtime's
grouped scheduler deals it (batch 4 on 3 stages: 2, 1, 1 rows). Decode runs in the runtime's
steady state (groups cycle through the stages; a step lasts max(round trip, busiest stage's work
of all groups)); prefill is a fill-drain pass (the last microbatch leaves the last stage after
sum(stage times) + (m - 1) x the slowest stage's time). TTFT is the first microbatch's
first token; TPOT is, as measured, decode time / steps from that token on, so it holds the rest
of the prefill (the fill: the last microbatch's first token minus the first's) spread over the
steps, and the bubble is that TPOT beyond one microbatch's stage times. Stage
processes slow each other: just before each configuration, n = 1 .. min(microbatches, stages)
spawned processes run the Q4_1 decode over 64 MiB of weights side by side for a second; their
pace (n over their summed passes per second) against one process alone, linear in between, is
taken for each stage at the number of processes busy while it computes, itself plus the others'
utilisations (a fixed point of the estimate); the upper bound with all n busy is column
`contention` of the JSON rows. This covers the cores (S = 3 busy stages on 2 cores share them),
shared caches and memory; the runnable threads of other work (/proc/stat procs_running) are
recorded beside it as `background_load`. No figure of these end-to-end runs enters the model.
"Least disturbed run" is the repeat with the lowest TPOT, the one closest to the quiet machine
the profile's primitives describe."""


def checkpoint_quant(ckpt) -> tuple[str, str]:
    """GGUF block types of the decoder linears and of the embedding ('' where dense)."""
    from stagewise import ops

    names = {v: k.lower() for k, v in ops.QTYPES.items()}
    qtype = getattr(ckpt, "qtype", lambda name: None)
    layer = next((n for n in sorted(ckpt.names()) if n.endswith("mlp.down_proj.weight")), None)
    embed = "model.embed_tokens.weight"
    q_layer = qtype(layer) if layer else None
    q_embed = qtype(embed) if embed in ckpt.names() else None
    return names.get(q_layer, ""), names.get(q_embed, "")


def measure(model: str, stages: int, *, batch: int, input_length: int, output_length: int,
            transport: str | None = None, repeats: int = 3, log=print) -> MeasuredRun:
    """Run ``model`` split into ``stages`` stages on this machine and time it (median of ``repeats``).

    The one place that talks to the runtime: S = 1 runs the single-process engine, S > 1 the
    stage processes (:class:`stagewise.Pipeline` with ``stages=S``, one torch thread per stage),
    whose per-stage busy time comes from the stages' own trace spans (the first compute and send
    of each microbatch group are its prefill and are left out).
    """
    from stagewise.api import Pipeline

    if stages == 1 and transport not in (None, "tcp"):
        raise ValueError(f"plan validate: --transport {transport!r} applies to stages > 1; with one stage "
                         "nothing is sent")
    max_len = input_length + output_length + 1
    options = {} if stages == 1 else {"transport": transport or "auto", "threads": 1}
    pipe = Pipeline(model, stages=stages, dtype="float32", max_num_seqs=batch, max_model_len=max_len,
                    max_num_tokens=batch * max_len, **options)
    try:
        prompts = make_prompts(pipe.checkpoint, batch, input_length)
        pipe.generate(prompt_token_ids=prompts, max_new_tokens=2, ignore_eos=True)  # warm-up
        ttfts, tpots, busy_runs, send_runs = [], [], [], []
        for i in range(repeats):
            pipe.generate(prompt_token_ids=prompts, max_new_tokens=output_length, ignore_eos=True)
            s = pipe.last_stats
            steps = s["decode_tokens"] / batch
            ttfts.append(s["ttft_s"])
            tpots.append(s["decode_s"] / steps)
            if stages > 1:
                spans = [decode_spans(st["trace"]) for st in pipe.stage_stats(trace=True)]
                busy_runs.append([b / steps for b, _ in spans])
                send_runs.append([t / steps for _, t in spans])
            log(f"  S={stages} run {i + 1}/{repeats}: TTFT {1e3 * ttfts[-1]:.1f} ms, TPOT {1e3 * tpots[-1]:.2f} ms")
    finally:
        pipe.close()
    tpot = statistics.median(tpots)
    if stages == 1:
        busy, send = [tpot], [0.0]
    else:
        busy = [statistics.median(run[i] for run in busy_runs) for i in range(stages)]
        send = [statistics.median(run[i] for run in send_runs) for i in range(stages)]
    microbatches = min(batch, stages)
    # The bubble: the step's latency beyond the sum of one microbatch's stage times.
    bubble = max(0.0, tpot - (sum(busy) + sum(send)) / microbatches) if stages > 1 else 0.0
    # The least disturbed run (lowest TPOT): on a shared machine, the one closest to the conditions
    # the profile's primitives describe; reported beside the medians.
    k = min(range(len(tpots)), key=tpots.__getitem__)
    if stages == 1:
        best = {"tpot_s": tpots[k], "ttft_s": ttfts[k], "per_stage_busy_s": [tpots[k]], "bubble_s": 0.0}
    else:
        best = {"tpot_s": tpots[k], "ttft_s": ttfts[k], "per_stage_busy_s": busy_runs[k],
                "bubble_s": max(0.0, tpots[k] - (sum(busy_runs[k]) + sum(send_runs[k])) / microbatches)}
    return MeasuredRun(stages=stages, per_stage_busy_s=busy, tpot_s=tpot, ttft_s=statistics.median(ttfts),
                       bubble_s=bubble, details={"ttft_runs_s": ttfts, "tpot_runs_s": tpots,
                                                 "busy_runs_s": busy_runs, "send_per_step_s": send,
                                                 "microbatches": microbatches, "best_run": best})


def decode_spans(trace) -> tuple[float, float]:
    """Seconds of ``compute`` and of ``send`` in a stage's trace ``(name, start, dur, microbatch)``
    after each microbatch's first (its prefill)."""
    seen: set[tuple[str, int]] = set()
    total = {"compute": 0.0, "send": 0.0}
    for name, _start, dur, mb in sorted(trace, key=lambda e: e[1]):
        if name not in total:
            continue
        if (name, mb) not in seen:
            seen.add((name, mb))
            continue
        total[name] += dur
    return total["compute"], total["send"]



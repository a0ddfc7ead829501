"""The runs of `stagewise plan validate`: a pipeline started (:func:`measure`, the one place that
talks to the runtime) and driven through a prompt batch a few times, its TTFT, TPOT and each
stage's busy time per decode step (:class:`MeasuredRun`)."""

from __future__ import annotations

import statistics

from stagewise.bench.e2e.prompts import make_prompts
from stagewise.planner.validate import MeasuredRun


def time_runs(pipe, stages: int, *, batch: int, input_length: int, output_length: int, repeats: int, log,
              tp: int = 1, dcp: int = 1) -> MeasuredRun:
    """Time ``pipe`` (``stages`` stages of ``tp`` ranks; one stage of one rank: the single-process
    engine) on ``batch`` prompts (median of ``repeats``, after a warm-up), then close it."""
    processes = stages * tp > 1
    label = f"S={stages}" + (f" tp={tp} dcp={dcp}" if (tp, dcp) != (1, 1) else "")
    try:
        prompts = make_prompts(pipe.checkpoint, batch, input_length)
        pipe.generate(prompt_token_ids=prompts, max_new_tokens=2, ignore_eos=True)  # warm-up
        prefill_comm = None
        if tp > 1:  # the prefill alone: its collectives and fan-out, to take off the leaders' counters
            pipe.generate(prompt_token_ids=prompts, max_new_tokens=1, ignore_eos=True)
            prefill_comm = [(st["collective_s"], st["fanout_s"]) for st in pipe.stage_stats()]
        ttfts, tpots, busy_runs, send_runs, coll_runs, fan_runs = [], [], [], [], [], []
        for i in range(repeats):
            pipe.generate(prompt_token_ids=prompts, max_new_tokens=output_length, ignore_eos=True)
            s = pipe.last_stats
            steps = s["decode_tokens"] / batch
            ttfts.append(s["ttft_s"])
            tpots.append(s["decode_s"] / steps)
            if processes:
                stats = pipe.stage_stats(trace=True)
                spans = [decode_spans(st["trace"]) for st in stats]
                busy_runs.append([b / steps for b, _ in spans])
                send_runs.append([t / steps for _, t in spans])
                if prefill_comm is not None:
                    coll_runs.append(sum(st["collective_s"] - c for st, (c, _) in zip(stats, prefill_comm)) / steps)
                    fan_runs.append(sum(st["fanout_s"] - f for st, (_, f) in zip(stats, prefill_comm)) / steps)
            log(f"  {label} run {i + 1}/{repeats}: TTFT {1e3 * ttfts[-1]:.1f} ms, TPOT {1e3 * tpots[-1]:.2f} ms")
    finally:
        pipe.close()
    tpot = statistics.median(tpots)
    if not processes:
        busy, send = [tpot], [0.0]
    else:
        busy = [statistics.median(run[i] for run in busy_runs) for i in range(stages)]
        send = [statistics.median(run[i] for run in send_runs) for i in range(stages)]
    microbatches = min(batch, stages)
    # The bubble: the step's latency beyond the sum of one microbatch's stage times.
    bubble = max(0.0, tpot - (sum(busy) + sum(send)) / microbatches) if processes else 0.0
    # The least disturbed run (lowest TPOT): on a shared machine, the one closest to the conditions
    # the profile's primitives describe; reported beside the medians.
    k = min(range(len(tpots)), key=tpots.__getitem__)
    if not processes:
        best = {"tpot_s": tpots[k], "ttft_s": ttfts[k], "per_stage_busy_s": [tpots[k]], "bubble_s": 0.0}
    else:
        best = {"tpot_s": tpots[k], "ttft_s": ttfts[k], "per_stage_busy_s": busy_runs[k],
                "bubble_s": max(0.0, tpots[k] - (sum(busy_runs[k]) + sum(send_runs[k])) / microbatches)}
    return MeasuredRun(stages=stages, per_stage_busy_s=busy, tpot_s=tpot, ttft_s=statistics.median(ttfts),
                       bubble_s=bubble, tp=tp, dcp=dcp,
                       details={"ttft_runs_s": ttfts, "tpot_runs_s": tpots, "busy_runs_s": busy_runs,
                                "send_per_step_s": send, "microbatches": microbatches, "best_run": best,
                                **({"collective_per_step_s": statistics.median(coll_runs),
                                    "fanout_per_step_s": statistics.median(fan_runs),
                                    "collective_runs_s": coll_runs} if coll_runs else {})})


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


def measure(model: str, stages: int, *, batch: int, input_length: int, output_length: int,
            transport: str | None = None, repeats: int = 3, log=print, tp: int = 1, dcp: int = 1,
            kv_cache_dtype: str = "auto") -> MeasuredRun:
    """Run ``model`` split into ``stages`` stages of ``tp`` ranks (``dcp`` of them sharding each KV
    head's sequence), K/V stored as ``kv_cache_dtype`` says, on this machine and time it (median of
    ``repeats``).

    The one place that talks to the runtime: one stage of one rank runs the single-process engine,
    anything else the stage processes (:class:`stagewise.Pipeline` with ``stages=S, tp=T,
    dcp=D``, one torch thread per rank), whose per-stage busy time comes from the stage leaders'
    own trace spans (the first compute and send of each microbatch group are its prefill and are
    left out).
    """
    from stagewise.api import Pipeline

    processes = stages * tp > 1
    if not processes and transport not in (None, "tcp"):
        raise ValueError(f"plan validate: --transport {transport!r} applies to stages > 1; with one stage "
                         "nothing is sent")
    max_len = input_length + output_length + 1
    options = {} if not processes else {"transport": transport or "auto", "threads": 1}
    if dcp > 1:
        options["interleave_size"] = 1  # tokens dealt to the DCP ranks in turn, as the planner splits them
    # No prefix cache: the runs repeat their prompts, and the planner predicts a prompt computed whole.
    pipe = Pipeline(model, stages=stages, tp=tp, dcp=dcp, dtype="float32", max_num_seqs=batch,
                    max_model_len=max_len, max_num_tokens=batch * max_len, kv_cache_dtype=kv_cache_dtype,
                    prefix_cache=False, **options)
    return time_runs(pipe, stages, batch=batch, input_length=input_length, output_length=output_length,
                     repeats=repeats, log=log, tp=tp, dcp=dcp)

"""``stagewise plan validate`` against a device profile: each configuration (batch, stages, TP,
DCP) predicted from the profile (:mod:`stagewise.planner.estimate`) and run for real
(:func:`stagewise.bench.plan_validate.runs.measure`), the rows compared
(:mod:`stagewise.planner.validate`) and written, and the planner's validation record updated unless
the run is ``--tiny`` or ``--no-store``."""

from __future__ import annotations

import dataclasses
import json
import os

from stagewise.bench import report
from stagewise.bench.plan_validate import runs
from stagewise.bench.profile.runtime import background_load, concurrent_pass_s
from stagewise.bench.regroup import describe_shapes, model_shapes
from stagewise.model.quant import checkpoint_quant
from stagewise.parallel.ranks import ParallelConfig
from stagewise.planner import validate as val
from stagewise.planner.estimate import Workload, contention, estimate_layout, ranks_outnumber_cores
from stagewise.planner.profiles import load_profile, profile_from_dict


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


def _oversubscribed(rows: list[dict], cores: int | None) -> list[str]:
    """A paragraph naming the cells with more rank processes than cores (none: nothing)."""
    cells = sorted({(r["batch"], r["stages"], r.get("tp", 1), r.get("dcp", 1))
                    for r in rows if r.get("oversubscribed")})
    if not cells:
        return []
    return [f"Cells with more rank processes (S x TP) than the {cores} cores (batch, S, TP, DCP): "
            f"{', '.join(map(str, cells))}. There a stage's ranks wait in their collectives for partners the OS "
            "has descheduled, which the planner does not price (its estimate says so in a note): their TPOT "
            "runs above the prediction.", ""]


def stage_layouts(config, tps: list[int], dcps: list[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int, str]]]:
    """The (tp, dcp) pairs of ``tps`` x ``dcps`` the model allows, in order, and the others with why
    (:func:`stagewise.model.shapes.parallel_problems`)."""
    from stagewise.model.shapes import parallel_problems

    ok, skipped = [], []
    for tp in dict.fromkeys(tps):
        for dcp in dict.fromkeys(dcps):
            problems = parallel_problems(config, tp, dcp)
            if problems:
                skipped.append((tp, dcp, problems[0]))
            else:
                ok.append((tp, dcp))
    return ok, skipped


def _cell(args, profile, config, work: Workload, B: int, S: int, tp: int, dcp: int, log) -> list[dict]:
    """Predict and measure one configuration: ``S`` stages of ``tp`` ranks (``dcp`` of them sharding
    each KV head's sequence) at batch ``B``; its comparison rows."""
    # Other work on the machine just before this configuration runs (0 off Linux), and how fast
    # its busy processes can run side by side now, against the profile's one.
    background = background_load() if profile.kind == "cpu" else None
    run_profile, n = profile, min(B, S)
    if profile.kind == "cpu" and profile.concurrency and n * tp > 1:
        # n busy stages of tp rank processes each, against one process alone, measured back to back
        # now (the profile's rates are those of one process alone: one is the reference).
        conc = {str(k): concurrent_pass_s(k) for k in range(1, n * tp + 1)}
        run_profile = dataclasses.replace(profile, concurrency=conc)
    # A stage's ranks compute at once: n busy stages are n * tp busy processes.
    run_profile = run_profile.for_ranks(tp)
    parallel = ParallelConfig(world_size=S * tp, pp=S, tp=tp, dcp=dcp)
    est = estimate_layout(config, parallel, work, run_profile)
    slow = contention(run_profile, S, B if args.microbatches is None else args.microbatches)
    where = f"B={B} S={S}" + (f" tp={tp} dcp={dcp}" if (tp, dcp) != (1, 1) else "")
    log(f"{where}: background load {background if background is not None else 0:.2f}, {n * tp} busy "
        f"process(es) now {slow:.2f}x the profile's pace; predicted TTFT {1e3 * est.ttft_s:.1f} ms, "
        f"TPOT {1e3 * est.tpot_s:.2f} ms; measuring ...")
    options = {"tp": tp, "dcp": dcp} if (tp, dcp) != (1, 1) else {}
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    try:
        measured = runs.measure(args.model, S, batch=B, input_length=args.input_length,
                                output_length=args.output_length, transport=args.transport,
                                repeats=args.repeats, log=log, **options)
    except (NotImplementedError, ValueError, RuntimeError, TimeoutError) as err:
        raise ValueError(str(err)) from None
    over = ranks_outnumber_cores(parallel, run_profile)
    return [{"batch": B, "background_load": background, "contention": slow, "oversubscribed": over, **r}
            for r in val.compare(est, measured)]


RANKS_METHOD = """Stages of several ranks (TP, DCP cells): each rank is a process with one torch thread,
the ranks of a stage meet in collectives (torch.distributed's gloo over loopback, or shared memory
where the runtime runs a CPU group's collectives so). The planner prices every collective
of a rank's step (two all-reduces a layer, the logits gathered to the stage's leader; with DCP the
query all-gather and that of the partial outputs and LSEs) on the profile's TP link, measured by
`stagewise bench profile` as all-reduces and all-gathers of 2 KiB - 1 MiB in the TP group of a
stage of two rank processes on this machine, each after a few linears as in a step, joined as the runtime joins it (the profile's
`measured.raw.tp_link.group` says over what), fitted to its ring formulas (latency and
bandwidth). The ranks of a
stage compute at once, so n busy stages are n x tp busy processes sharing the cores: the pace of
n x tp processes side by side, measured just before the configuration, against one alone
(column `contention`). Row `collectives` (a diagnostic, in no error band): per decode step, the
stage leaders' time inside their collectives (waiting for the other rank included; the prefill's,
from a prompt-only run, taken off) against the predicted comm-bound ops."""


def run(args, ckpt, info: dict, model_name: str, model_note: str, layouts: list[tuple[int, int]],
        skipped: list[tuple[int, int, str]], log) -> int:
    """Predict and run every cell of ``layouts`` x ``args.stages`` x ``args.batch`` (``info``: the
    machine; ``skipped``: the (tp, dcp) the model does not allow, with why), write the results."""
    config = ckpt.config
    if args.device_profile:
        profile = load_profile(args.device_profile)
    else:
        from stagewise.bench.profile.device import measure_profile

        log("measuring this machine's profile now")
        profile = profile_from_dict(measure_profile("cpu", quick=args.tiny, log=log), "measured in the same run")
    profile = profile.with_transport(args.transport) if args.transport and args.transport in profile.transports \
        else profile
    weight_quant, embed_quant = checkpoint_quant(ckpt)

    def workload(batch: int) -> Workload:
        return Workload(input_length=args.input_length, output_length=args.output_length, batch=batch,
                        microbatches=args.microbatches, weight_dtype="float32", kv_dtype="float32",
                        weight_quant=weight_quant, embed_quant=embed_quant, kv_cache_dtype=args.kv_cache_dtype)
    if profile.kind == "cpu" and any(tp > 1 for tp, _ in layouts) and "tp_link" not in profile.measured.get("raw", {}):
        log("note: this profile's TP link was not measured (no tp_link among its measurements); the TP cells' "
            "collectives are priced at its 'tp' link as given")
    load_before = os.getloadavg()
    rows = []
    for B in args.batch:
        for S in args.stages:
            for tp, dcp in layouts:
                rows += _cell(args, profile, config, workload(B), B, S, tp, dcp, log)
    table = val.format_rows(rows)
    print(table)
    load_after = os.getloadavg()
    wl = {"batch": list(args.batch), "tp": [tp for tp, _ in layouts], "dcp": [d for _, d in layouts],
          "input_length": args.input_length, "output_length": args.output_length,
          "microbatches": args.microbatches, "dtype": "float32", "threads": args.threads,
          "weight_quant": weight_quant, "embed_quant": embed_quant, "kv_cache_dtype": args.kv_cache_dtype}
    info = {**info, "load_average_before": list(load_before), "load_average_after": list(load_after)}
    data = val.summary(rows, model=model_name, architecture=config.architecture,
                       profile={"name": profile.name, "kind": profile.kind, "source": profile.source},
                       workload=wl, machine=info)
    data["model_file"] = args.model if args.heads else None
    data["model_note"] = model_note or None
    data["model_shapes"] = model_shapes(config)
    data["skipped"] = [{"tp": tp, "dcp": dcp, "why": why} for tp, dcp, why in skipped]
    report.write_results(args.out, f"{info['device']}-plan-validate", data, [
        "# Planner predictions against measured runs", "",
        f"Machine: {info['device_name']} ({info['device']}), {args.threads} torch thread(s); torch {info['torch']}  ",
        f"Date (UTC): {info['date_utc']}; commit: {info['git_commit']}  ",
        f"Model: {model_name}{f' ({model_note})' if model_note else ''}; {describe_shapes(config)}; "
        f"layouts (TP, DCP): {', '.join(f'({t}, {d})' for t, d in layouts)}"
        + "".join(f"; skipped tp={t} dcp={d}: {why}" for t, d, why in skipped) + "  ",
        f"Workload: float32 activations, {weight_quant or 'dense'} linears, {embed_quant or 'dense'} "
        f"embedding/LM head, {args.kv_cache_dtype} KV cache, batch {' and '.join(map(str, args.batch))}, "
        f"prompt {args.input_length}, {args.output_length} new tokens; "
        f"median of {args.repeats} runs  ", f"Profile: {profile.name} ({profile.source})  ",
        f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; after: "
        f"{', '.join(f'{x:.2f}' for x in load_after)} (2-core machine, shared)", "",
        "Error = (predicted - measured) / measured; the bubble's error is in % of the measured TPOT.", "",
        table, "", *_oversubscribed(rows, profile.cores), VALIDATE_METHOD, "", RANKS_METHOD, ""], log=log)
    if args.tiny:
        log("toy sizes (--tiny): the planner's validation record stays as it is")
    elif not args.no_store:
        val.STORE.write_text(json.dumps(data, indent=2) + "\n")
        log(f"updated the planner's validation record {val.STORE}")
    return 0



"""``stagewise plan validate MODEL --partition measured``: the prediction of a measured split
(:mod:`stagewise.launch.measured`) against the run it gives.

For each stage count, the stages' nodes are measured by their probes as ``--partition measured``
measures them (seconds, then cached per host, device and threads), the layers are split, and the
pipeline runs on that split, each stage with its threads (``--stage-threads``: stages on one machine
with different threads are nodes of different speeds). The split's prediction — each stage's
decode-step time and the TPOT at batch 1, hops not counted — is compared with each stage's measured
busy time per decode step and the measured TPOT. Results go to
``<out>/<device>-plan-validate-measured.{json,md}``; the planner's validation record (which holds
the profile-based predictions) is left as it is.
"""

from __future__ import annotations

import os

METHOD = """Method: before each run the stage processes start as probes (as for `--partition measured`);
each measures its node with the planner's profile primitives at its own threads (matmul rate, copy
bandwidth, op overhead, the block-quantised linear of the model's GGUF types, the decode attention
kernel, the per-layer framework cost and each stage role's fixed cost per step; cached per host,
device and threads), the driver splits the layers so that the slowest stage is fastest within each
node's memory, and the stages start on that split. Predicted: each stage's decode-step time at
batch 1 (its layers, the embedding on stage 0, the LM head and sampling on the last, its role's
fixed cost) and the TPOT, their sum (the hops between stages are not counted, so the TPOT's error
holds them). Measured: each stage's busy time per decode step (its leader's own trace spans, the
prefill left out) and decode time / steps, median of the runs; "least disturbed run" is the run
with the lowest TPOT."""


def stage_threads(spec: str | None, stages: int, default: int) -> list[int]:
    """Each stage's torch threads: ``spec`` ``"2,1"`` dealt to the stages in turn (None: ``default``)."""
    if spec is None:
        return [default] * stages
    try:
        given = [int(t) for t in spec.split(",")]
    except ValueError:
        given = []
    if not given or min(given) < 1:
        raise ValueError(f"--stage-threads: expected threads >= 1 separated by commas (e.g. 2,1), got {spec!r}")
    return [given[i % len(given)] for i in range(stages)]


def measured_cell(args, checkpoint, stages: int, log) -> list[dict]:
    """Split ``checkpoint``'s layers over ``stages`` measured stages, run the split at batch 1 and
    compare: the rows of :func:`stagewise.planner.validate.finish_rows`."""
    from stagewise.api import Pipeline
    from stagewise.bench.plan_validate.runs import time_runs
    from stagewise.launch.measured import measured_split
    from stagewise.launch.start import start_stages
    from stagewise.parallel.runplan import RunPlan
    from stagewise.planner import validate as val

    threads = stage_threads(args.stage_threads, stages, args.threads)
    max_len = args.input_length + args.output_length + 1
    plan = RunPlan.from_dict({"model": args.model, "partition": "measured", "dtype": "float32", "max_num_seqs": 1,
                              "max_model_len": max_len, "transport": args.transport or "auto",
                              "kv_cache_dtype": args.kv_cache_dtype, "prefix_cache": False,
                              "stages": [{"threads": t} for t in threads]}, checkpoint.config.num_layers)
    placed, split = measured_split(plan, checkpoint, lambda p, **kw: start_stages(p, "local", **kw),
                                   log=lambda line: log(f"  {line}"), remeasure=args.remeasure)
    procs, placed, addresses = start_stages(placed, "local")
    try:
        pipe = Pipeline.attach(placed, addresses=addresses, processes=procs)
    except BaseException:
        procs.stop(2.0)
        raise
    measured = time_runs(pipe, stages, batch=1, input_length=args.input_length, output_length=args.output_length,
                         repeats=args.repeats, log=log)
    rows = [{"metric": "tpot", "predicted_s": split.tpot_s, "measured_s": measured.tpot_s}]
    rows += [{"metric": f"stage{i}_busy", "predicted_s": p, "measured_s": b}
             for i, (p, b) in enumerate(zip(split.stage_s, measured.per_stage_busy_s))]
    ranges = ", ".join(f"{a}-{b}" for a, b in split.ranges)
    return [{"batch": 1, "threads": threads, "ranges": ranges, **r} for r in val.finish_rows(rows, measured)]


def run(args, checkpoint, info: dict, model_name: str, log) -> int:
    """Every stage count of ``args.stages``: measured, split, run and compared; the results written."""
    from stagewise.bench import report
    from stagewise.bench.regroup import describe_shapes
    from stagewise.planner import validate as val

    if args.batch != [1] or args.tp != [1] or args.dcp != [1] or args.microbatches not in (None, 1):
        raise ValueError("--partition measured predicts batch 1 on stages of one rank: --batch, --tp, --dcp and "
                         "--microbatches do not apply")
    config = checkpoint.config
    load_before = os.getloadavg()
    rows, cells = [], []
    for stages in args.stages:
        log(f"S={stages}: measuring the nodes and splitting the layers ...")
        got = measured_cell(args, checkpoint, stages, log)
        rows += got
        cells.append(f"S={stages}: threads {got[0]['threads']}, layers {got[0]['ranges']}")
    load_after = os.getloadavg()
    table = val.format_rows(rows)
    print(table)
    data = {"date_utc": info["date_utc"], "machine": {**info, "load_average_before": list(load_before),
                                                      "load_average_after": list(load_after)},
            "model": model_name, "partition": "measured", "rows": rows,
            "workload": {"batch": 1, "input_length": args.input_length, "output_length": args.output_length,
                         "repeats": args.repeats, "stage_threads": args.stage_threads, "threads": args.threads}}
    lines = [
        "# A measured split's prediction against its run", "",
        f"Machine: {info['device_name']} ({info['device']}); torch {info['torch']}  ",
        f"Date (UTC): {info['date_utc']}; commit: {info['git_commit']}  ",
        f"Model: {model_name}; {describe_shapes(config)}  ",
        f"Workload: float32 activations, batch 1, prompt {args.input_length}, {args.output_length} new tokens; "
        f"median of {args.repeats} runs  ", f"Splits: {'; '.join(cells)}  ",
        f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; after: "
        f"{', '.join(f'{x:.2f}' for x in load_after)}", "",
        "Error = (predicted - measured) / measured.", "", table, "", METHOD, ""]
    report.write_results(args.out, f"{info['device']}-plan-validate-measured", data, lines, log=log)
    log("the planner's validation record stays as it is (it holds the profile-based predictions)")
    return 0

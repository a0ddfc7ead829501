"""The run of ``stagewise bench kernels`` (:mod:`stagewise.bench.kernels`): for every case, validate
OURS against the reference once (max abs error), then time OURS, the pure-torch baseline,
torch.compile of that baseline, FlashInfer when available and, for attention, SDPA and FlexAttention
over the same paged cache (each checked against OURS first; median after warm-up), and express
OURS as GB/s and as a percentage of the copy and of the read bandwidth measured in the same run
(the read one is the ceiling of ops that mostly read, such as a decode step's linears). An op that
raises becomes an error row and the run goes on.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from stagewise.bench import report
from stagewise.bench.kernels import cases
from stagewise.bench.kernels import report as table
from stagewise.measure.timing import TimingPolicy, copy_bandwidth, read_bandwidth, time_fn


def _policy(args, device: str) -> TimingPolicy:
    if args.quick or args.tiny:
        policy = TimingPolicy(warmup=2, min_repeats=3, max_repeats=20, budget_s=0.1)
    elif device == "cuda":
        policy = TimingPolicy(warmup=5, min_repeats=10, max_repeats=200, budget_s=0.5)
    else:
        policy = TimingPolicy(warmup=3, min_repeats=5, max_repeats=100, budget_s=0.3)
    if args.warmup is not None:
        policy.warmup = args.warmup
    if args.repeats is not None:
        policy.max_repeats = args.repeats
        policy.min_repeats = min(policy.min_repeats, args.repeats)
    policy.__post_init__()  # re-check the overrides
    return policy


def _describe(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _raise_recompile_limit() -> None:
    """dynamic=False compiles one graph per shape and dtype; past dynamo's limit
    (8 per function) it would silently run the baseline eagerly instead."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))


def _rotated(case: cases.Case, fn):
    """``fn``, after the case's ``rotate`` where it has one."""
    if case.rotate is None:
        return fn

    def call():
        case.rotate()
        return fn()

    return call


def measure(
    case: cases.Case, device: str, policy: TimingPolicy, compiled: dict | None, copy_gbps: float, read_gbps: float
) -> table.Row:
    """One table row. ``compiled`` maps op -> compiled baseline (None: no compile baseline)."""
    row = table.Row(op=case.op, case=case.name, dtype=str(case.dtype).removeprefix("torch."), nbytes=case.nbytes)
    notes: dict = {}
    try:  # validate before timing: a wrong kernel's speed means nothing
        err = case.validate()
        if not math.isfinite(err):
            raise ValueError(f"output differs from the reference by {err}")
        row.max_err = err
        t = time_fn(_rotated(case, case.ours), device, policy)
        row.ours_ms, notes["repeats"], notes["ours_min_ms"] = t.median_ms, t.repeats, t.min_ms
        row.gbps = case.nbytes / t.median_ms / 1e6
        row.pct_copy = 100 * row.gbps / copy_gbps
        row.pct_read = 100 * row.gbps / read_gbps
    except Exception as e:
        row.error = _describe(e)
    try:
        row.ref_ms = time_fn(_rotated(case, lambda: case.baseline(*case.baseline_args)), device, policy).median_ms
    except Exception as e:
        notes["ref"] = f"n/a: {_describe(e)}"
    if compiled is None:
        notes["compile"] = "skipped"
    else:
        try:
            if case.op not in compiled:  # once per op; each new shape is a recompile
                compiled[case.op] = torch.compile(case.baseline, dynamic=False)
            fn = compiled[case.op]
            t0 = time.perf_counter()
            fn(*case.baseline_args)
            _sync(device)
            notes["compile_s"] = round(time.perf_counter() - t0, 2)
            row.compile_ms = time_fn(_rotated(case, lambda: fn(*case.baseline_args)), device, policy).median_ms
        except Exception as e:
            notes["compile"] = f"n/a: {_describe(e)}"
    if case.flashinfer is None:
        notes["flashinfer"] = case.flashinfer_note
    else:
        try:
            row.flashinfer_ms = time_fn(case.flashinfer, device, policy).median_ms
        except Exception as e:
            notes["flashinfer"] = f"n/a: {_describe(e)}"
    if case.others:
        _measure_others(case, device, policy, row, notes)
    row.notes = notes
    return row


def _measure_others(case: cases.Case, device: str, policy: TimingPolicy, row: table.Row, notes: dict) -> None:
    """The case's further baselines (``Case.others``): each run once and checked against ours' first
    output (that first call is where FlexAttention compiles: ``<name>_first_call_s``), then timed."""
    expected = None
    if row.error is None:  # ours ran: its outputs, to check each against
        expected = case.ours()
        expected = expected[0] if isinstance(expected, tuple) else expected
    for name, other in case.others.items():
        if isinstance(other, str):
            notes[name] = other
            continue
        try:
            t0 = time.perf_counter()
            got = other()
            _sync(device)
            notes[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 2)
            if expected is not None:
                err = cases.max_abs_err(got, expected)
                if not math.isfinite(err):
                    raise ValueError(f"output differs from ours by {err}")
                notes[f"{name}_max_err"] = err
            del got
            setattr(row, f"{name}_ms", time_fn(other, device, policy).median_ms)
        except Exception as e:
            notes[name] = f"n/a: {_describe(e)}"


def run(args: argparse.Namespace, log) -> int:
    """Time every case of the ops asked for; print the table, write <device>-kernels.json and .md."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("stagewise bench: --device cuda was asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    ops_wanted = list(cases.OPS) if not args.ops else [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops_wanted if o not in cases.OPS]
    if unknown or not ops_wanted:
        print(f"stagewise bench: --ops must name ops among {', '.join(cases.OPS)}, got {args.ops!r}", file=sys.stderr)
        return 2
    try:
        policy = _policy(args, device)
    except ValueError as e:
        print(f"stagewise bench: {e}", file=sys.stderr)
        return 2
    preset = "tiny" if args.tiny else "quick" if args.quick else "full"
    compiled = None if args.no_compile else {}
    if compiled is not None:
        _raise_recompile_limit()

    info = report.machine_info(device)
    # Far beyond the last-level cache: 1 GiB on a GPU, 256 MiB on a CPU (16 MiB for --tiny).
    copy_bytes = 2**30 if device == "cuda" else 2**24 if args.tiny else 2**28
    copy_bw = copy_bandwidth(device, copy_bytes, policy)
    read_bw = read_bandwidth(device, copy_bytes, policy)
    print(f"{info['device_name']}: copy bandwidth {copy_bw['gbps']:.1f} GB/s, read bandwidth {read_bw['gbps']:.1f} GB/s",
          file=sys.stderr)

    rows = []
    specs = cases.case_specs(device, ops_wanted, preset)
    for i, (op, dtype, size) in enumerate(specs, 1):
        dtype_name = str(dtype).removeprefix("torch.")
        print(f"[{i}/{len(specs)}] {op} {size} {dtype_name}", file=sys.stderr, flush=True)
        torch.manual_seed(i)
        try:
            case = cases.build_case(op, dtype, size, device)
        except Exception as e:  # e.g. out of memory: report it, go on
            rows.append(table.Row(op=op, case=str(size), dtype=dtype_name, nbytes=0, error=f"setup: {_describe(e)}"))
            continue
        rows.append(measure(case, device, policy, compiled, copy_bw["gbps"], read_bw["gbps"]))
        del case
        if device == "cuda":
            torch.cuda.empty_cache()

    print(table.format_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{info['device']}-kernels"
    info.update(preset=preset, timing=policy_dict(policy))
    table.write_json(stem.with_suffix(".json"), info, copy_bw, rows, read_bw)
    table.write_markdown(stem.with_suffix(".md"), info, copy_bw, rows, read_bw)
    print(f"wrote {stem}.json and {stem}.md", file=sys.stderr)
    return 0


def policy_dict(policy: TimingPolicy) -> dict:
    return {k: getattr(policy, k) for k in ("warmup", "min_repeats", "max_repeats", "budget_s")}

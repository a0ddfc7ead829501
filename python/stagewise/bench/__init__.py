"""`stagewise bench kernels`: each op against its baselines, into a JSON + Markdown table.
`stagewise bench e2e`: whole-model generation against transformers (see :mod:`stagewise.bench.e2e`).
`stagewise bench transport`: latency and GB/s of each transport (see :mod:`stagewise.bench.transport`).
`stagewise bench profile`: this machine as a planner device profile (see :mod:`stagewise.bench.profile`).
`stagewise bench serve`: `stagewise serve` against llama.cpp's OpenAI server under load (see
:mod:`stagewise.bench.serve`).

``--tiny`` (or ``STAGEWISE_BENCH_TINY=1`` in the environment) runs any suite at toy sizes with the
fewest repeats: a check that the command works (the documentation's examples run this way), whose
numbers mean nothing.

For every case: validate OURS against the reference once (max abs error), then
time OURS, the pure-torch baseline, torch.compile of that baseline and
FlashInfer when available (median after warm-up), and express OURS as GB/s and
as a percentage of the copy and of the read bandwidth measured in the same run
(the read one is the ceiling of ops that mostly read, such as a decode step's
linears). An op that raises becomes an error row and the run goes on.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

from stagewise.bench import kernels, report
from stagewise.bench.timing import TimingPolicy, copy_bandwidth, read_bandwidth, time_fn
from stagewise.transport.select import TRANSPORTS

SUITES = ("kernels", "e2e", "transport", "profile", "serve")
TINY_ENV = "STAGEWISE_BENCH_TINY"
"""Set to 1, it has every suite (and ``stagewise plan validate``) run as with ``--tiny``."""
E2E_SIZES = {"batch_sizes": ("1,16", "1"), "prompt_len": (128, 8), "new_tokens": (64, 4), "repeats": (3, 1)}
"""e2e's sizes when not given: (full, --tiny)."""


def tiny_from_environment(log=None) -> bool:
    """Whether ``STAGEWISE_BENCH_TINY=1`` asks for toy sizes (said on ``log`` when it does)."""
    value = os.environ.get(TINY_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{TINY_ENV} must be 1 (toy sizes) or 0, got {value!r}")
    if value == "1" and log is not None:
        log(f"{TINY_ENV}=1: toy sizes and the fewest repeats, as with --tiny; the numbers mean nothing")
    return value == "1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", choices=SUITES, help="what to benchmark")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda if available, else cpu")
    parser.add_argument("--ops", default=None,
                        help=f"comma-separated subset of: {','.join(kernels.OPS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes, dtypes and repeats")
    parser.add_argument("--tiny", action="store_true",
                        help=f"toy sizes and the fewest repeats, to check that a suite works (the timings mean "
                             f"nothing; {TINY_ENV}=1 does the same)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--repeats", type=int, default=None,
                        help="most timed calls per measurement (e2e: timed runs per batch size, default 3; "
                             "--tiny: 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls before timing")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for <device>-<suite>.json and .md (default: a new folder "
                             "bench/results/<device>-<date>, never the committed results, and ignored by git; "
                             "<device> names the CPU model and the ISA level the kernels ran at)")  # fmt: skip
    e2e_args = parser.add_argument_group("e2e")
    e2e_args.add_argument("--model", default="smollm2-135m",
                          help="e2e: folder, .gguf file, smollm2-135m, or random-qwen3-vl (a random Qwen3-VL of hidden "
                               "2048, 8 layers, ViT depth 8, built with transformers on first use)")
    e2e_args.add_argument("--image", default=None, metavar="WxH",
                          help="e2e, a vision model: every prompt starts with an image of this size, e.g. 448x448")
    e2e_args.add_argument("--batch-sizes", default=None,
                          help="e2e: comma-separated batch sizes (default: 1,16; --tiny: 1)")
    e2e_args.add_argument("--prompt-len", type=int, default=None,
                          help="e2e: prompt tokens per row (default: 128; --tiny: 8)")
    e2e_args.add_argument("--new-tokens", type=int, default=None,
                          help="e2e: generated tokens per row (default: 64; --tiny: 4)")
    e2e_args.add_argument("--linear-precision", default="exact,int8", metavar="exact,int8",
                          help="e2e and serve: ours' linear precisions, a row each (default: exact,int8; int8 over "
                               "GGUF blocks, or Q8_0 blocks quantised at load from float32 weights)")
    e2e_args.add_argument("--baseline", default="transformers", metavar="transformers,llama.cpp",
                          help="e2e: what ours runs beside, a column group each (default: transformers; llama.cpp: the "
                               "same GGUF through llama-cpp-python, an optional dependency)")
    e2e_args.add_argument("--install-baseline", action="store_true",
                          help="e2e --baseline llama.cpp: pip install llama-cpp-python (a native source build) when "
                               "it is missing")
    e2e_args.add_argument("--startup", action="store_true",
                          help="e2e: also time fresh processes to their first token (generate, a 3-stage pipeline "
                               "and, with that baseline, llama.cpp)")
    e2e_args.add_argument("--stages", default=None, metavar="1,2,3",
                          help="e2e: run the pipeline with these stage counts instead (batch 1 and S x 4 requests); "
                               "serve: ours as a pipeline of S stage processes (one number)")
    e2e_args.add_argument("--launcher", default=None, choices=["ray"],
                          help="e2e: a pipeline of --stages S (default 3) started by this launcher and by the local "
                               "one, side by side (start-up, TPOT at batch 1 and 8)")
    e2e_args.add_argument("--recovery", action="store_true",
                          help="e2e: a pipeline of --stages S (default 2) whose last stage dies or hangs mid-generation: "
                               "the delay with only that stage started again, beside every stage started again")
    e2e_args.add_argument("--tp", default=None, metavar="1,3",
                          help="e2e: one stage split over these tensor-parallel sizes instead, beside tp=1 (batch 1 and "
                               "the largest batch size)")
    e2e_args.add_argument("--dcp", default=None, metavar="1,3",
                          help="e2e --tp: also these decode-context-parallel sizes (each dividing its tp)")
    e2e_args.add_argument("--heads", default=None, metavar="Q/KV",
                          help="e2e --tp: run the GGUF model regrouped into Q query and KV key-value heads, every "
                               "other tensor as it is (SmolLM2's 9/3 allow tp 3 only; 8/1 allows tp 2 and dcp 2)")
    e2e_args.add_argument("--pipeline-partition", dest="partition", default="balanced",
                          help="e2e --stages: the partition policy (default: balanced)")
    e2e_args.add_argument("--pipeline-transport", dest="transport", default="auto", choices=TRANSPORTS,
                          help="e2e --stages: the transport between stages (default: auto)")
    serve_args = parser.add_argument_group("serve (also --model, --threads, --linear-precision, --install-baseline)")
    serve_args.add_argument("--rates", default=None, metavar="0.5,1,2,4",
                            help="serve: offered loads, requests per second (default 0.5,1,2,4)")
    serve_args.add_argument("--requests", type=int, default=None, metavar="N",
                            help="serve: requests per rate (default 40; --tiny: 4)")
    serve_args.add_argument("--server-baseline", dest="baseline_server", default="llama.cpp",
                            choices=["llama.cpp", "none"],
                            help="serve: the server run beside stagewise serve (default llama.cpp: llama-cpp-python's "
                                 "llama_cpp.server, an optional dependency)")
    serve_args.add_argument("--tpot-target", default="auto", metavar="auto|none|MS",
                            help="serve: ours also runs with this TPOT target, each --linear-precision (default auto: "
                                 "0.8 of llama.cpp's measured p99 TPOT; none: only ours as it starts by default)")
    transport_args = parser.add_argument_group("transport")
    from stagewise.bench.transport import TRANSPORTS as MEASURED

    transport_args.add_argument("--transports", default=None,
                                help=f"transport: comma-separated subset of {','.join(MEASURED)} (default: all)")


def resolve_e2e_sizes(args: argparse.Namespace) -> None:
    """Fill in the e2e sizes not given: toy ones with ``--tiny``, the full ones otherwise."""
    for name, (full, tiny) in E2E_SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)


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


def _rotated(case: kernels.Case, fn):
    """``fn``, after the case's ``rotate`` where it has one."""
    if case.rotate is None:
        return fn

    def call():
        case.rotate()
        return fn()

    return call


def measure(
    case: kernels.Case, device: str, policy: TimingPolicy, compiled: dict | None, copy_gbps: float, read_gbps: float
) -> report.Row:
    """One table row. ``compiled`` maps op -> compiled baseline (None: no compile baseline)."""
    row = report.Row(op=case.op, case=case.name, dtype=str(case.dtype).removeprefix("torch."), nbytes=case.nbytes)
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
    row.notes = notes
    return row


def run(args: argparse.Namespace) -> int:
    log = (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        args.tiny = args.tiny or tiny_from_environment(log)
    except ValueError as e:
        print(f"stagewise bench: {e}", file=sys.stderr)
        return 2
    if args.suite == "e2e":
        resolve_e2e_sizes(args)
    if args.threads is not None:
        if args.threads < 1:
            print(f"stagewise bench: --threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    if args.out is None:  # never over the committed results unless --out says so
        args.out = report.default_out(report.device_slug(args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    if args.suite == "profile":
        from stagewise.bench import profile

        return profile.run(args, log=log)
    if args.suite == "e2e" and (args.tp or args.dcp):
        from stagewise.bench import e2e_parallel

        return e2e_parallel.run(args, log=log)
    if args.suite == "e2e" and args.recovery:
        from stagewise.bench import e2e_recovery

        return e2e_recovery.run(args, log=log)
    if args.suite == "e2e" and args.launcher:
        from stagewise.bench import e2e_launchers

        return e2e_launchers.run(args, log=log)
    if args.suite == "e2e" and args.stages:
        from stagewise.bench import e2e_stages

        return e2e_stages.run(args, log=log)
    if args.suite == "e2e":
        from stagewise.bench import e2e

        return e2e.run(args, log=log)
    if args.suite == "serve":
        from stagewise.bench import serve

        return serve.run(args, log=log)
    if args.suite == "transport":
        from stagewise.bench import transport

        return transport.run(args, log=log)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("stagewise bench: --device cuda was asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    ops_wanted = list(kernels.OPS) if not args.ops else [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops_wanted if o not in kernels.OPS]
    if unknown or not ops_wanted:
        print(f"stagewise bench: --ops must name ops among {', '.join(kernels.OPS)}, got {args.ops!r}", file=sys.stderr)
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
    specs = kernels.case_specs(device, ops_wanted, preset)
    for i, (op, dtype, size) in enumerate(specs, 1):
        dtype_name = str(dtype).removeprefix("torch.")
        print(f"[{i}/{len(specs)}] {op} {size} {dtype_name}", file=sys.stderr, flush=True)
        torch.manual_seed(i)
        try:
            case = kernels.build_case(op, dtype, size, device)
        except Exception as e:  # e.g. out of memory: report it, go on
            rows.append(report.Row(op=op, case=str(size), dtype=dtype_name, nbytes=0, error=f"setup: {_describe(e)}"))
            continue
        rows.append(measure(case, device, policy, compiled, copy_bw["gbps"], read_bw["gbps"]))
        del case
        if device == "cuda":
            torch.cuda.empty_cache()

    print(report.format_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{info['device']}-kernels"
    info.update(preset=preset, timing=policy_dict(policy))
    report.write_json(stem.with_suffix(".json"), info, copy_bw, rows, read_bw)
    report.write_markdown(stem.with_suffix(".md"), info, copy_bw, rows, read_bw)
    print(f"wrote {stem}.json and {stem}.md", file=sys.stderr)
    return 0


def policy_dict(policy: TimingPolicy) -> dict:
    return {k: getattr(policy, k) for k in ("warmup", "min_repeats", "max_repeats", "budget_s")}

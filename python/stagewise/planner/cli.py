"""`stagewise plan ...`: the layout search, `plan memory`, `plan ranks` and `plan validate`.

    stagewise plan MODEL --num-devices 8 [--tp-sizes 1 2] [--pp-sizes [1 2 4]] [--ep-sizes ..]
                   [--moe-dp-sizes ..] --input-length 2048 --output-length 512 [--batch 8]
                   [--device-profile h100-sxm|FILE] [--partition even|ceil|balanced] [--json]
                   [--plot FILE.png] [--trace FILE.json]
    stagewise plan --config serving.yaml [MODEL]
    stagewise plan memory CONFIG --stages 2 4 8 [--max-ctx T] [--kv-dtype bf16] [--batch 1] [--json]
    stagewise plan ranks --world-size 8 --tp 2 --pp 4 [--ep 1] [--rank 4] [--json]
    stagewise plan validate MODEL --stages 1 2 3 [--transport tcp] [--device-profile FILE]

MODEL is a config.json (or a folder holding one), a built-in config name (qwen3-4b, falcon-40b,
qwen3-vl-235b-a22b) or a checkpoint stagewise can open (smollm2-135m). Like the original
optimizer's CLI, the model id may also trail the last size list (``--pp-sizes 1 2 4 MODEL``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from stagewise.model.config import ModelConfig
from stagewise.model.hf_config import parse_config_file

MODELS_DIR = Path(__file__).resolve().parent / "models"
ACTIONS = ("memory", "ranks", "validate")
SIZE_ARGS = ("tp_sizes", "pp_sizes", "ep_sizes", "moe_dp_sizes")


class PlanError(ValueError):
    """A user error: printed as ``stagewise plan: <message>``, exit status 2."""


def builtin_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def resolve_model(arg: str) -> tuple[ModelConfig, str]:
    """``(config, name)`` of a config file/folder, a built-in config or an openable checkpoint."""
    path = Path(arg)
    if path.is_file() and path.suffix == ".json" or path.is_dir() and (path / "config.json").is_file():
        name = path.stem if path.is_file() and path.name != "config.json" else path.resolve().parent.name \
            if path.is_file() else path.resolve().name
        return parse_config_file(path), name
    builtin = MODELS_DIR / f"{arg.lower()}.json"
    if builtin.is_file():
        return parse_config_file(builtin), arg.lower()
    from stagewise.model.loader import open_checkpoint

    try:
        return open_checkpoint(arg).config, path.stem or arg
    except (FileNotFoundError, ValueError) as err:
        raise PlanError(f"unknown model {arg!r}: not a config.json, a folder holding one, a built-in config "
                        f"({', '.join(builtin_models())}) or a checkpoint ({err})") from None


# --- argument parsing ----------------------------------------------------------------------------

def _search_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagewise plan", description="Search TP/PP/DP/EP layouts (seed 001 §2.2).")
    p.add_argument("model", nargs="?", help="config.json, folder, built-in config name or checkpoint")
    p.add_argument("--config", type=Path, help="serving YAML with parallel_config (world_size, tp_size, pp_size, "
                                               "dp_size); evaluates that one layout")
    p.add_argument("--num-devices", type=int, help="devices to spread the replicas over")
    for name, what in (("tp", "TP sizes (default: powers of two up to N)"),
                       ("pp", "PP sizes (not given: 1; given without values: powers of two up to N)"),
                       ("ep", "expert-parallel sizes (default 1)"), ("moe-dp", "MoE data-parallel sizes (default 1)")):
        p.add_argument(f"--{name}-sizes", nargs="*", default=None, metavar="N", help=what)
    p.add_argument("--input-length", type=int, help="prompt tokens per sequence")
    p.add_argument("--output-length", type=int, help="generated tokens per sequence")
    _workload_args(p)
    p.add_argument("--partition", default="even", help="even (seed 000), ceil (seed 001), balanced, or ranges "
                                                      "'0-10,10-22,...' for one PP size")
    p.add_argument("--total-params", type=float, default=None,
                   help="nominal parameter count for the rough weight estimate (default: from the model name)")
    p.add_argument("--top", type=int, default=None, help="print only the best K layouts")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", type=Path, help="PNG of the best layout's pipeline timeline (prefill + decode steps)")
    p.add_argument("--trace", type=Path, help="the same timeline as a Chrome trace (Perfetto)")
    return p


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=1, help="sequences per pipeline replica (default 1)")
    p.add_argument("--microbatches", type=int, default=None, help="default: min(batch, pp)")
    p.add_argument("--device-profile", default="h100-sxm",
                   help="built-in profile (h100-sxm, h200, a100, cpu-generic) or a JSON file from "
                        "`stagewise bench profile` (default h100-sxm)")
    p.add_argument("--transport", default=None, help="a measured transport of the profile as the PP link (e.g. tcp)")
    p.add_argument("--weight-dtype", default=None, help="bf16, fp16, fp32 or fp8 (default: the config's, else bf16)")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: the weights')")
    p.add_argument("--weight-quant", default=None, help="GGUF block type the decoder linears run in (q4_0, q4_1, "
                                                       "q8_0; time only, default dense)")
    p.add_argument("--embed-quant", default=None, help="GGUF block type of the embedding / LM head (time only)")
    p.add_argument("--memory-fraction", type=float, default=0.9, help="usable share of device memory (default 0.9)")


def _sizes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Turn size lists into ints; a trailing non-number of the last list is the model id."""
    for name in SIZE_ARGS:
        values = getattr(args, name)
        if values is None:
            continue
        if values and args.model is None and not values[-1].lstrip("-").isdigit():
            args.model = values.pop()
        ints = []
        for v in values:
            try:
                ints.append(int(v))
            except ValueError:
                parser.error(f"--{name.replace('_', '-')}: expected integers, got {v!r}")
        setattr(args, name, ints)


def _dtype_default(config: ModelConfig) -> str:
    import torch

    return {torch.float32: "float32", torch.float16: "float16"}.get(config.dtype, "bfloat16")


def _workload(args: argparse.Namespace, config: ModelConfig, input_length: int, output_length: int):
    from stagewise.planner.estimate import Workload

    for name, value in (("--input-length", input_length), ("--output-length", output_length),
                        ("--batch", args.batch)):
        if value is None:
            raise PlanError(f"{name} is required")
        if value < 1:
            raise PlanError(f"{name} must be a positive integer, got {value}")
    wd = args.weight_dtype or _dtype_default(config)
    return Workload(input_length=input_length, output_length=output_length, batch=args.batch,
                    microbatches=args.microbatches, weight_dtype=wd, kv_dtype=args.kv_dtype or wd,
                    memory_fraction=args.memory_fraction, weight_quant=(args.weight_quant or "").lower(),
                    embed_quant=(args.embed_quant or "").lower())


def _profile(args: argparse.Namespace):
    from stagewise.planner.profiles import load_profile

    return load_profile(args.device_profile).with_transport(args.transport)


# --- formatting ---------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _annotations(est, workload, profile, config, validation) -> tuple[str, list[str]]:
    if validation is None:
        return "unvalidated", ["no validation on record"]
    flags = validation.flags(stages=est.layout.pp, batch=workload.batch, input_length=workload.input_length,
                             output_length=workload.output_length, architecture=config.architecture,
                             profile_name=profile.name, profile_kind=profile.kind)
    e = validation.expected_error_pct
    err = f"±{e['tpot']:.0f}%" if "tpot" in e else "?"
    return err, flags


def format_search(results, rejected, *, name, config, workload, profile, validation, num_devices, top) -> str:
    lines = [f"model {name} ({config.architecture}, {config.num_layers} layers), {num_devices} x {profile.name}, "
             f"input {workload.input_length}, output {workload.output_length}, batch {workload.batch} per replica, "
             f"weights {workload.weight_dtype}, KV {workload.kv_dtype}",
             validation.describe() if validation else "no validation on record: predictions unchecked", "",
             ]
    header = ["#", "parallel", "stages", "weights/rank", "KV/rank", "fits", "TTFT ms", "TPOT ms", "tok/s",
              "TPOT error", "flags"]
    table: list[list[str]] = []
    shown = results[:top] if top else results
    breakdowns = []
    for i, r in enumerate(shown, 1):
        err, flags = _annotations(r, workload, profile, config, validation)
        table.append([str(i), r.layout.label(), str(r.plan), _gib(r.weight_bytes_per_rank), _gib(r.kv_bytes_per_rank),
                      "yes" if r.fits else "NO", f"{1e3 * r.ttft_s:.2f}", f"{1e3 * r.tpot_s:.3f}",
                      f"{r.tokens_per_s:.1f}", err, "; ".join(flags) or "-"])
        breakdowns.append(f"{i}. {r.layout.label()}  prefill: {r.prefill.breakdown_line()}")
        breakdowns.append(f"{' ' * len(str(i))}  {' ' * len(r.layout.label())}  decode:  {r.decode.breakdown_line()}")
    widths = [max(len(row[k]) for row in [header, *table]) for k in range(len(header))]
    right = {0, 3, 4, 6, 7, 8}
    for row in [header, *table]:
        lines.append("  ".join(c.rjust(w) if k in right else c.ljust(w)
                               for k, (c, w) in enumerate(zip(row, widths))).rstrip())
    if len(shown) < len(results):
        lines.append(f"({len(results) - len(shown)} more layouts not shown)")
    lines += ["", "Breakdown (% of op time | % of pipeline latency):", *breakdowns]
    if rejected:
        lines += ["", f"{len(rejected)} combinations rejected:"]
        lines += [f"  TP={r.tp} PP={r.pp} EP={r.ep} MOE_DP={r.moe_dp}: {r.reason}" for r in rejected[:10]]
        if len(rejected) > 10:
            lines.append(f"  ... and {len(rejected) - 10} more (see --json)")
    return "\n".join(lines)


def _timeline(est, decode_steps: int = 4):
    from stagewise.planner.timeline import phase_events

    events = phase_events(est.prefill, "prefill")
    t = est.prefill.pipeline.latency_s
    for k in range(decode_steps):
        step = phase_events(est.decode, f"decode{k}", t)
        events += step
        # Each step drawn as one pass from idle (its groups may overrun the steady-state step time).
        t = max(t + est.decode.pipeline.latency_s, max(e.start_s + e.dur_s for e in step))
    return events


def _write_pictures(args, est, name: str, profile) -> list[str]:
    written = []
    if not (args.plot or args.trace):
        return written
    events = _timeline(est)
    title = f"{name} {est.layout.label()} on {profile.name}: prefill then decode steps"
    if args.trace:
        from stagewise.trace import write_chrome_trace

        write_chrome_trace(args.trace, events, num_stages=est.plan.num_stages, process="predicted",
                           other={"model": name, "parallel": est.layout.label(), "profile": profile.name,
                                  "stage_ranges": est.plan.ranges, "units": "seconds in args, us in ts/dur"})
        written.append(str(args.trace))
    if args.plot:
        from stagewise.planner.timeline import write_png

        write_png(args.plot, events, num_stages=est.plan.num_stages, title=title)
        written.append(str(args.plot))
    return written


# --- commands -----------------------------------------------------------------------------------

def run_search(argv: list[str]) -> int:
    parser = _search_parser()
    args = parser.parse_args(argv)
    _sizes(args, parser)
    from stagewise.planner.search import model_accepts, search
    from stagewise.planner.estimate import estimate_layout
    from stagewise.planner.memory import nominal_params
    from stagewise.planner.validate import load_latest

    serving = None
    if args.config is not None:
        from stagewise.planner.serving import load_serving_yaml

        serving = load_serving_yaml(args.config)
        if args.model is None:
            args.model = serving.model
        args.input_length = args.input_length or serving.input_length
        args.output_length = args.output_length or serving.output_length
        if serving.batch is not None and args.batch == 1:
            args.batch = serving.batch
        if serving.device_profile and args.device_profile == "h100-sxm":
            args.device_profile = serving.device_profile
        if any(getattr(args, n) is not None for n in SIZE_ARGS) or args.num_devices is not None:
            raise PlanError("--config gives the layout; leave out --num-devices and the --*-sizes lists")
    if args.model is None:
        raise PlanError("a MODEL (config.json, folder, built-in name or checkpoint) is required")
    config, name = resolve_model(args.model)
    workload = _workload(args, config, args.input_length, args.output_length)
    profile = _profile(args)
    total = args.total_params or nominal_params(name)
    if serving is not None:
        layout = serving.parallel
        reason = model_accepts(config, layout, args.partition)
        if reason:
            raise PlanError(f"{args.config}: layout {layout.label()} does not fit the model: {reason}")
        results = [estimate_layout(config, layout, workload, profile, partition=args.partition, total_params=total)]
        rejected, num_devices = [], layout.world_size
    else:
        if args.num_devices is None:
            raise PlanError("--num-devices is required (or give --config serving.yaml)")
        if args.top is not None and args.top < 1:
            raise PlanError(f"--top must be >= 1, got {args.top}")
        num_devices = args.num_devices
        results, rejected = search(
            config, num_devices=num_devices, workload=workload, profile=profile, tp_sizes=args.tp_sizes,
            pp_sizes=args.pp_sizes, ep_sizes=args.ep_sizes, moe_dp_sizes=args.moe_dp_sizes,
            partition=args.partition, total_params=total)
    validation = load_latest()
    written = _write_pictures(args, results[0], name, profile)
    if args.json:
        layouts = []
        for r in results[: args.top] if args.top else results:
            d = r.to_dict()
            err, flags = _annotations(r, workload, profile, config, validation)
            d.update(expected_error=err, flags=flags)
            layouts.append(d)
        print(json.dumps({"model": name, "architecture": config.architecture, "num_devices": num_devices,
                          "profile": profile.name, "workload": {
                              "input_length": workload.input_length, "output_length": workload.output_length,
                              "batch": workload.batch, "microbatches": workload.microbatches,
                              "weight_dtype": workload.weight_dtype, "kv_dtype": workload.kv_dtype},
                          "validation": validation.describe() if validation else None,
                          "layouts": layouts,
                          "rejected": [{"tp": r.tp, "pp": r.pp, "ep": r.ep, "moe_dp": r.moe_dp, "reason": r.reason}
                                       for r in rejected],
                          "files": written}, indent=2))
    else:
        print(format_search(results, rejected, name=name, config=config, workload=workload, profile=profile,
                            validation=validation, num_devices=num_devices, top=args.top))
        for f in written:
            print(f"wrote {f}")
    return 0


def run_memory(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="stagewise plan memory",
                                description="Per-stage layers, weights and KV (seed 000 §2.5 tables, rough and exact).")
    p.add_argument("model", help="config.json, folder, built-in config name or checkpoint")
    p.add_argument("--stages", type=int, nargs="+", required=True, help="stage counts, e.g. 2 4 8")
    p.add_argument("--max-ctx", type=int, default=None, help="tokens per sequence (default max_position_embeddings)")
    p.add_argument("--weight-dtype", default=None, help="default: the config's dtype, else bf16")
    p.add_argument("--kv-dtype", default=None, help="default: the weights' dtype")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tp", type=int, default=1, help="bytes of one TP rank of each stage (default 1)")
    p.add_argument("--partition", default="even", choices=("even", "ceil"))
    p.add_argument("--total-params", type=float, default=None,
                   help="nominal parameters for the rough estimate (default: from the model name, else the exact count)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from stagewise.model import shapes
    from stagewise.parallel.plan import StagePlan
    from stagewise.planner.memory import format_tables, nominal_params, stage_memory
    from stagewise.planner.profiles import DTYPE_BYTES, dtype_name

    config, name = resolve_model(args.model)
    bad = [s for s in args.stages if s < 1]
    if bad or args.batch < 1 or args.tp < 1 or (args.max_ctx is not None and args.max_ctx < 1):
        raise PlanError(f"--stages, --batch, --tp and --max-ctx must be positive integers, got stages={args.stages}, "
                        f"batch={args.batch}, tp={args.tp}, max_ctx={args.max_ctx}")
    wd = dtype_name(args.weight_dtype or _dtype_default(config))
    kd = dtype_name(args.kv_dtype or wd)
    tokens = args.max_ctx or config.max_position_embeddings
    ctx_label = "max_ctx" if args.max_ctx is None else f"T={tokens}"
    nominal = args.total_params or nominal_params(name)
    exact_total = shapes.count(config, shapes.model_tensors(config))
    nominal_label = (f"~{nominal / 1e9:.4g}B params" + (" by model name" if not args.total_params else "")
                     if nominal else f"{exact_total / 1e9:.4g}B params counted")
    nominal_label += f" x {DTYPE_BYTES[wd]} bytes"
    sharding = shapes.Sharding(tp=args.tp)
    shapes.check_sharding(config, sharding)
    plans, tables = [], []
    for S in args.stages:
        plan = StagePlan.for_model(config, S, args.partition, allow_empty=args.partition == "ceil")
        mem = stage_memory(config, plan, tokens=tokens, batch=args.batch, weight_bytes=DTYPE_BYTES[wd],
                           kv_bytes_per_elem=DTYPE_BYTES[kd], total_params=nominal, sharding=sharding)
        plans.append({"num_stages": S, "stages": [m.to_dict() for m in mem]})
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8": "fp8"}
        tables.append(format_tables(mem, weight_dtype=short[wd], kv_dtype=short[kd], ctx_label=ctx_label,
                                    nominal_label=nominal_label))
    if args.json:
        print(json.dumps({"model": name, "num_layers": config.num_layers, "tokens": tokens, "batch": args.batch,
                          "tp": args.tp, "weight_dtype": wd, "kv_dtype": kd, "total_params_exact": exact_total,
                          "total_params_rough": nominal or exact_total, "plans": plans}, indent=2))
    else:
        print(f"{name}: {config.num_layers} decoder layers, {exact_total:,} parameters counted from the tensor shapes, "
              f"KV at {tokens:,} tokens x batch {args.batch}, partition {args.partition}"
              + (f", one of {args.tp} TP ranks" if args.tp > 1 else "") + "\n")
        print("\n\n".join(tables))
    return 0


def run_ranks(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="stagewise plan ranks", description="Rank groups (seed 001 §2.3).")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--moe-dp", type=int, default=1)
    p.add_argument("--rank", type=int, default=None, help="show this rank's groups only")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from stagewise.parallel.ranks import ParallelConfig

    cfg = ParallelConfig.from_sizes(args.world_size, args.tp, args.pp, args.ep, args.moe_dp)
    kinds = ["tp", "pp", "dp"] + (["ep", "moe_tp", "moe_dp"] if args.ep > 1 or args.moe_dp > 1 else [])
    ranks = range(cfg.world_size) if args.rank is None else [args.rank]
    rows = [{"rank": r, **cfg.coordinates(r),
             **{f"{k}_group": list(cfg.group(k, r).rank_group) for k in kinds},
             **{f"{k}_rank_in_group": cfg.group(k, r).rank_in_group for k in kinds}} for r in ranks]
    if args.json:
        print(json.dumps({"layout": cfg.label(), "groups": {k: [list(g) for g in cfg.groups(k)] for k in kinds},
                          "ranks": rows}, indent=2))
        return 0
    print(f"{cfg.label()} (world size {cfg.world_size}; ranks laid out as [DP, PP, TP], TP fastest)")
    for k in kinds:
        print(f"{k} groups: {' '.join(str(list(g)) for g in cfg.groups(k))}")
    print()
    print("| rank | dp | pp (stage) | tp | " + " | ".join(f"{k} group (index)" for k in kinds) + " |")
    print("|---:|---:|---:|---:|" + "|".join(":---" for _ in kinds) + "|")
    for r in rows:
        cells = [f"{r[f'{k}_group']} ({r[f'{k}_rank_in_group']})" for k in kinds]
        print(f"| {r['rank']} | {r['dp']} | {r['pp']} | {r['tp']} | " + " | ".join(cells) + " |")
    return 0


def run_validate(argv: list[str]) -> int:
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
    p.add_argument("--input-length", type=int, default=128)
    p.add_argument("--output-length", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the profile is measured)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--no-store", action="store_true", help="do not update the planner's validation record")
    args = p.parse_args(argv)
    import torch

    from stagewise.bench import report
    import dataclasses

    from stagewise.bench.profile_runtime import background_load, concurrent_pass_s
    from stagewise.planner.estimate import contention
    from stagewise.parallel.ranks import ParallelConfig
    from stagewise.planner import validate as val
    from stagewise.planner.estimate import Workload, estimate_layout
    from stagewise.planner.profiles import load_profile, profile_from_dict

    if min(args.stages) < 1 or min(args.batch) < 1 or args.input_length < 1 or args.output_length < 2 or args.repeats < 1:
        raise PlanError("--stages, --batch, --input-length, --repeats must be >= 1 and --output-length >= 2")
    torch.set_num_threads(args.threads)
    log = (lambda line: print(line, file=sys.stderr, flush=True))
    info = report.machine_info("cpu")
    if args.device_profile:
        profile = load_profile(args.device_profile)
    else:
        from stagewise.bench.profile import measure_profile

        log("measuring this machine's profile now")
        profile = profile_from_dict(measure_profile("cpu", log=log), "measured in the same run")
    profile = profile.with_transport(args.transport) if args.transport and args.transport in profile.transports \
        else profile
    from stagewise.model.loader import open_checkpoint

    ckpt = open_checkpoint(args.model)
    config = ckpt.config
    weight_quant, embed_quant = _checkpoint_quant(ckpt)
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
                measured = val.measure(args.model, S, batch=B, input_length=args.input_length,
                                       output_length=args.output_length, transport=args.transport,
                                       repeats=args.repeats, log=log)
            except (NotImplementedError, ValueError, RuntimeError, TimeoutError) as err:
                raise PlanError(str(err)) from None
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
    if not args.no_store:
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
of all groups)); prefill is a fill-drain pass (seed 001 §2.7.4). TTFT is the first microbatch's
first token; TPOT is, as measured, decode time / steps from that token on, so it holds the rest
of the prefill (the fill: the last microbatch's first token minus the first's) spread over the
steps, and the bubble is that TPOT beyond one microbatch's stage times (seed 001 §2.8). Stage
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


def _checkpoint_quant(ckpt) -> tuple[str, str]:
    """GGUF block types of the decoder linears and of the embedding ('' where dense)."""
    from stagewise import ops

    names = {v: k.lower() for k, v in ops.QTYPES.items()}
    qtype = getattr(ckpt, "qtype", lambda name: None)
    layer = next((n for n in sorted(ckpt.names()) if n.endswith("mlp.down_proj.weight")), None)
    embed = "model.embed_tokens.weight"
    q_layer = qtype(layer) if layer else None
    q_embed = qtype(embed) if embed in ckpt.names() else None
    return names.get(q_layer, ""), names.get(q_embed, "")


def main(argv: list[str]) -> int:
    try:
        if argv and argv[0] in ACTIONS:
            return {"memory": run_memory, "ranks": run_ranks, "validate": run_validate}[argv[0]](argv[1:])
        return run_search(argv)
    except (PlanError, ValueError, FileNotFoundError) as err:
        print(f"stagewise plan: {err}", file=sys.stderr)
        return 2

"""`stagewise plan ...`: the layout search, `plan memory`, `plan ranks` and `plan validate`.

    stagewise plan MODEL --num-devices 8 [--tp-sizes 1 2] [--pp-sizes [1 2 4]] [--pcp-sizes ..]
                   [--dcp-sizes ..] [--ep-sizes ..] [--moe-dp-sizes ..] [--input-length 2048] [--output-length 512] [--batch 8]
                   [--device-profile h100-sxm|FILE] [--partition even|ceil|balanced] [--json]
                   [--kv-cache-dtype auto|int8|fp8_e4m3] [--plot FILE.png] [--trace FILE.json]
    stagewise plan --config serving.yaml [MODEL]
    stagewise plan memory CONFIG --stages 2 4 8 [--max-ctx T] [--kv-dtype bf16] [--kv-cache-dtype int8]
                          [--batch 1] [--tp 1] [--dcp 1] [--pcp 1] [--json]
    stagewise plan ranks --world-size 8 --tp 2 --pp 4 [--ep 1] [--rank 4] [--json]
    stagewise plan validate MODEL --stages 1 2 3 [--transport tcp] [--device-profile FILE]

MODEL is a config.json (or a folder holding one), a built-in config name (qwen3-4b, falcon-40b,
qwen3-vl-235b-a22b) or a checkpoint stagewise can open (smollm2-135m). The model id may also
come last, after the size lists (``--pp-sizes 1 2 4 MODEL``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stagewise.kv.cache import KV_CACHE_DTYPES, kv_row_bytes
from stagewise.model.config import ModelConfig
from stagewise.planner import report
from stagewise.planner.models import PlanError, builtin_models, resolve_model

ACTIONS = ("memory", "ranks")
SIZE_ARGS = ("tp_sizes", "pp_sizes", "pcp_sizes", "dcp_sizes", "ep_sizes", "moe_dp_sizes")
DEFAULT_INPUT_LENGTH = 2048
DEFAULT_OUTPUT_LENGTH = 512
"""The workload when neither the command line nor a serving YAML gives one: a long-ish chat or
RAG prompt and a medium answer, the case most layout questions are about."""
KV_CACHE_HELP = ("what the runtime stores K/V as (a run plan's kv_cache_dtype): auto (default), the dtype "
                 "--kv-dtype names; int8 or fp8_e4m3, one-byte codes with a float16 scale per token and KV head, "
                 "head_dim + 2 bytes a row instead of head_dim x the dtype's")
EVEN_CEIL = ("even: L // S layers per stage, the first (L mod S) stages one more; ceil: ceil(L / S) per stage from "
             "the first, the last stages fewer")
PARTITIONS = f"{EVEN_CEIL}; balanced: the embedding and LM head weigh on the edge stages"
OTHER_COMMANDS = """other commands (each has its own --help):
  stagewise plan memory MODEL --stages 2 4 8          per-stage layers, weights and KV cache
  stagewise plan ranks --world-size 8 --tp 2 --pp 4   the rank groups of a layout
  stagewise plan validate MODEL --stages 1 2 3        run the pipeline here and compare with the prediction"""


# --- argument parsing ----------------------------------------------------------------------------

def _search_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stagewise plan", epilog=OTHER_COMMANDS, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Search the TP/PP/DP/PCP/DCP/EP layouts of a model on N devices: for each valid layout, best first, "
                    "memory per rank, TTFT, TPOT, tokens/s and where the time goes, each with the error of the "
                    "latest validation where it covers the case.")
    p.add_argument("model", nargs="?", help="config.json, folder, built-in config name "
                                            f"({', '.join(builtin_models())}) or checkpoint")
    p.add_argument("--config", type=Path, help="serving YAML with parallel_config (world_size, tp_size, pp_size, "
                                               "dp_size) and optionally the model and workload; evaluates that one "
                                               "layout (example: examples/serving.yaml)")
    p.add_argument("--num-devices", type=int, help="devices to spread the replicas over")
    for name, what in (("tp", "TP sizes (default: powers of two up to N)"),
                       ("pp", "PP sizes (not given: 1; given without values: powers of two up to N)"),
                       ("pcp", "prefill-context-parallel sizes: ranks of a stage splitting each prompt and sharing "
                               "its KV, world = tp * pcp * pp * dp (default 1)"),
                       ("dcp", "decode-context-parallel sizes: TP ranks holding copies of one KV head that shard "
                               "its sequence instead; must divide tp / num_key_value_heads (default 1)"),
                       ("ep", "expert-parallel sizes (default 1)"), ("moe-dp", "MoE data-parallel sizes (default 1)")):
        p.add_argument(f"--{name}-sizes", nargs="*", default=None, metavar="N", help=what)
    p.add_argument("--input-length", type=int,
                   help=f"prompt tokens per sequence (default: the serving YAML's, else {DEFAULT_INPUT_LENGTH})")
    p.add_argument("--output-length", type=int,
                   help=f"generated tokens per sequence (default: the serving YAML's, else {DEFAULT_OUTPUT_LENGTH})")
    p.add_argument("--image-tokens", type=int, default=0, metavar="N",
                   help="a vision model: one image of N merged tokens in each prompt (part of --input-length), "
                        "whose vision tower the prefill runs on stage 0 (default 0: text only)")
    p.add_argument("--prefix-share", type=float, default=None, metavar="F",
                   help="the share of each prompt found in the prefix cache (0-1: a shared system prompt, a "
                        "resent conversation), whose KV the prefill reuses instead of computing (default: the "
                        "serving YAML's, else 0)")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding: K draft tokens per request and decode step, verified in one step "
                        "(default 0: none)")
    p.add_argument("--acceptance", type=float, default=0.7, metavar="A",
                   help="with --speculative-tokens: the chance each draft is accepted (default 0.7; `stagewise "
                        "generate --json` and the server's metrics report the measured one)")
    _workload_args(p)
    p.add_argument("--partition", default="even", help=f"{PARTITIONS}; or ranges '0-10,10-22,...' for one PP size "
                                                      "(default even)")
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
    p.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default=None, help=KV_CACHE_HELP)
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


def _kv_cache_dtype(args: argparse.Namespace, given: str | None = None) -> str:
    """``--kv-cache-dtype``, else ``given`` (a serving YAML's), else ``auto``; PlanError when
    ``--kv-dtype`` is given too, as both would say what K/V are stored as."""
    kcd = args.kv_cache_dtype or given or "auto"
    if kcd != "auto" and args.kv_dtype:
        raise PlanError(f"--kv-dtype {args.kv_dtype} and kv_cache_dtype {kcd} both say what K/V are stored as: "
                        f"{kcd} stores one-byte codes with a float16 scale; leave out --kv-dtype")
    return kcd


def _workload(args: argparse.Namespace, config: ModelConfig, input_length: int, output_length: int,
              kv_cache_dtype: str = "auto"):
    from stagewise.planner.estimate import Workload

    for name, value in (("--input-length", input_length), ("--output-length", output_length),
                        ("--batch", args.batch)):
        if value < 1:
            raise PlanError(f"{name} must be a positive integer, got {value}")
    share = getattr(args, "prefix_share", None) or 0.0
    if not 0 <= share <= 1:
        raise PlanError(f"--prefix-share must be in [0, 1], got {share}")
    drafts, acceptance = getattr(args, "speculative_tokens", 0), getattr(args, "acceptance", 0.7)
    if drafts < 0 or not 0 <= acceptance <= 1:
        raise PlanError(f"--speculative-tokens must be >= 0 and --acceptance in [0, 1], got {drafts} and {acceptance}")
    image_tokens = getattr(args, "image_tokens", 0)
    if not 0 <= image_tokens <= input_length:
        raise PlanError(f"--image-tokens must be in [0, --input-length {input_length}], got {image_tokens}")
    if image_tokens and config.vision_config is None:
        raise PlanError(f"--image-tokens {image_tokens}: the model is text-only (no vision tower)")
    wd = args.weight_dtype or _dtype_default(config)
    return Workload(input_length=input_length, output_length=output_length, batch=args.batch,
                    microbatches=args.microbatches, weight_dtype=wd, kv_dtype=args.kv_dtype or wd,
                    memory_fraction=args.memory_fraction, weight_quant=(args.weight_quant or "").lower(),
                    embed_quant=(args.embed_quant or "").lower(), image_tokens=getattr(args, "image_tokens", 0),
                    prefix_share=share, speculative_tokens=drafts, acceptance=acceptance if drafts else 0.0,
                    kv_cache_dtype=kv_cache_dtype)


def _profile(args: argparse.Namespace):
    from stagewise.planner.profiles import load_profile

    return load_profile(args.device_profile).with_transport(args.transport)


# --- commands -----------------------------------------------------------------------------------

def run_search(argv: list[str]) -> int:
    parser = _search_parser()
    args = parser.parse_args(argv)
    _sizes(args, parser)
    from stagewise.planner.search import model_accepts, search
    from stagewise.planner.estimate import estimate_layout
    from stagewise.planner.memory import nominal_params
    from stagewise.planner.validate import load_latest

    serving, kv_cache_dtype = None, _kv_cache_dtype(args)
    if args.config is not None:
        from stagewise.planner.serving import load_serving_yaml

        serving = load_serving_yaml(args.config)
        if args.model is None:
            args.model = serving.model
        args.input_length = args.input_length or serving.input_length
        args.output_length = args.output_length or serving.output_length
        if args.prefix_share is None:
            args.prefix_share = serving.prefix_share
        if serving.batch is not None and args.batch == 1:
            args.batch = serving.batch
        if serving.device_profile and args.device_profile == "h100-sxm":
            args.device_profile = serving.device_profile
        kv_cache_dtype = _kv_cache_dtype(args, serving.kv_cache_dtype)
        if any(getattr(args, n) is not None for n in SIZE_ARGS) or args.num_devices is not None:
            raise PlanError("--config gives the layout; leave out --num-devices and the --*-sizes lists")
    if args.model is None:
        raise PlanError("a MODEL (config.json, folder, built-in name or checkpoint) is required")
    config, name = resolve_model(args.model)
    input_length = DEFAULT_INPUT_LENGTH if args.input_length is None else args.input_length
    output_length = DEFAULT_OUTPUT_LENGTH if args.output_length is None else args.output_length
    workload = _workload(args, config, input_length, output_length, kv_cache_dtype)
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
            pcp_sizes=args.pcp_sizes, dcp_sizes=args.dcp_sizes, partition=args.partition, total_params=total)
    validation = load_latest()
    from stagewise.planner.timeline import write_pictures

    written = write_pictures(results[0], name, profile, plot=args.plot, trace=args.trace)
    view = dict(name=name, config=config, workload=workload, profile=profile, validation=validation,
                num_devices=num_devices, top=args.top)
    if args.json:
        print(json.dumps(report.search_json(results, rejected, files=written, **view), indent=2))
    else:
        print(report.format_search(results, rejected, **view))
        for f in written:
            print(f"wrote {f}")
    return 0


def run_memory(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="stagewise plan memory",
                                description="Per-stage layers, weights and KV cache of S-stage pipelines: first a rough table "
                                            "(weights proportional to the stage's share of the layers, from the "
                                            "nominal parameter count), then the exact count from the tensor shapes "
                                            "(the edge stages hold the embedding, final norm and LM head).")
    p.add_argument("model", help="config.json, folder, built-in config name or checkpoint")
    p.add_argument("--stages", type=int, nargs="+", required=True, help="stage counts, e.g. 2 4 8")
    p.add_argument("--max-ctx", type=int, default=None, help="tokens per sequence (default max_position_embeddings)")
    p.add_argument("--weight-dtype", default=None, help="default: the config's dtype, else bf16")
    p.add_argument("--kv-dtype", default=None, help="default: the weights' dtype")
    p.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default=None, help=KV_CACHE_HELP)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tp", type=int, default=1, help="bytes of one TP rank of each stage (default 1)")
    p.add_argument("--dcp", type=int, default=1, help="decode context parallel: the TP ranks holding one KV head "
                                                     "shard its sequence (divides tp / num_key_value_heads; default 1)")
    p.add_argument("--pcp", type=int, default=1, help="prefill context parallel: ranks of a stage sharing each "
                                                     "sequence's KV (default 1)")
    p.add_argument("--partition", default="even", choices=("even", "ceil"), help=f"{EVEN_CEIL} (default even)")
    p.add_argument("--total-params", type=float, default=None,
                   help="nominal parameters for the rough estimate (default: from the model name, else the exact count)")
    p.add_argument("--memory-gib", type=float, default=None, metavar="GIB",
                   help="memory of one rank for weights and KV: each table then names the largest batch of "
                        "sequences of the context that fits")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from stagewise.model import shapes
    from stagewise.parallel.plan import StagePlan
    from stagewise.planner.memory import check_layout, format_tables, max_batch, nominal_params, stage_memory
    from stagewise.planner.profiles import DTYPE_BYTES, dtype_name

    config, name = resolve_model(args.model)
    bad = [s for s in args.stages if s < 1]
    if args.memory_gib is not None and not args.memory_gib > 0:
        raise PlanError(f"--memory-gib must be a positive number, got {args.memory_gib}")
    if bad or min(args.batch, args.tp, args.dcp, args.pcp) < 1 or (args.max_ctx is not None and args.max_ctx < 1):
        raise PlanError(f"--stages, --batch, --tp, --dcp, --pcp and --max-ctx must be positive integers, got "
                        f"stages={args.stages}, batch={args.batch}, tp={args.tp}, dcp={args.dcp}, pcp={args.pcp}, "
                        f"max_ctx={args.max_ctx}")
    wd = dtype_name(args.weight_dtype or _dtype_default(config))
    kd, kcd = dtype_name(args.kv_dtype or wd), _kv_cache_dtype(args)
    row = kv_row_bytes(config.head_dim, DTYPE_BYTES[kd], kcd)
    tokens = args.max_ctx or config.max_position_embeddings
    ctx_label = "max_ctx" if args.max_ctx is None else f"T={tokens}"
    nominal = args.total_params or nominal_params(name)
    exact_total = shapes.count(config, shapes.model_tensors(config))
    nominal_label = (f"~{nominal / 1e9:.4g}B params" + (" by model name" if not args.total_params else "")
                     if nominal else f"{exact_total / 1e9:.4g}B params counted")
    nominal_label += f" x {DTYPE_BYTES[wd]} bytes"
    sharding = shapes.Sharding(tp=args.tp, dcp=args.dcp, pcp=args.pcp)
    check_layout(config, sharding)
    plans, tables = [], []
    for S in args.stages:
        plan = StagePlan.for_model(config, S, args.partition, allow_empty=args.partition == "ceil")
        mem = stage_memory(config, plan, tokens=tokens, batch=args.batch, weight_bytes=DTYPE_BYTES[wd],
                           kv_bytes_per_elem=DTYPE_BYTES[kd], total_params=nominal, sharding=sharding,
                           kv_cache_dtype=kcd)
        plans.append({"num_stages": S, "stages": [m.to_dict() for m in mem]})
        fit = None
        if args.memory_gib is not None:
            plans[-1]["max_batch"] = max_batch(mem, args.memory_gib * 2**30)
            fit = f"In {args.memory_gib:g} GiB a rank holds {plans[-1]['max_batch']:,} sequences of {tokens:,} tokens."
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8": "fp8"}
        tables.append(format_tables(mem, weight_dtype=short[wd], kv_dtype=short[kd] if kcd == "auto" else kcd,
                                    ctx_label=ctx_label, nominal_label=nominal_label, fit=fit))
    if args.json:
        print(json.dumps({"model": name, "num_layers": config.num_layers, "tokens": tokens, "batch": args.batch,
                          "tp": args.tp, "dcp": args.dcp, "pcp": args.pcp, "weight_dtype": wd, "kv_dtype": kd,
                          "kv_cache_dtype": kcd, "kv_bytes_per_token_row": row, "total_params_exact": exact_total,
                          "total_params_rough": nominal or exact_total, "plans": plans}, indent=2))
    else:
        print(f"{name}: {config.num_layers} decoder layers, {exact_total:,} parameters counted from the tensor shapes, "
              f"KV at {tokens:,} tokens x batch {args.batch}, partition {args.partition}"
              + (f", KV as {kcd} codes and a float16 scale, {row} bytes a token row of a KV head (K, and again V)"
                 if kcd != "auto" else "")
              + (f", one of {args.tp} TP ranks" if args.tp > 1 else "")
              + (f", each sequence's KV spread over pcp x dcp = {args.pcp} x {args.dcp} ranks"
                 if args.pcp * args.dcp > 1 else "") + "\n")
        print("\n\n".join(tables))
    return 0


def run_ranks(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="stagewise plan ranks",
                                description="The rank groups of a layout, as the runtime builds them: ranks laid out "
                                            "as [DP, PP, PCP, TP], TP fastest (a stage's PCP x TP ranks are "
                                            "contiguous); DCP groups are runs of DCP ranks inside a TP group; with "
                                            "EP or MoE DP, the expert groups span all ranks (EP x MoE-TP x MoE-DP = "
                                            "world).")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--pcp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--moe-dp", type=int, default=1)
    p.add_argument("--rank", type=int, default=None, help="show this rank's groups only")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from stagewise.parallel.ranks import ParallelConfig

    cfg = ParallelConfig.from_sizes(args.world_size, args.tp, args.pp, args.ep, args.moe_dp, pcp=args.pcp,
                                    dcp=args.dcp)
    kinds = (["tp"] + (["dcp"] if cfg.dcp > 1 else []) + (["pcp"] if cfg.pcp > 1 else []) + ["pp", "dp"]
             + (["ep", "moe_tp", "moe_dp"] if args.ep > 1 or args.moe_dp > 1 else []))
    dims = ["dp", "pp"] + (["pcp"] if cfg.pcp > 1 else []) + ["tp"]
    ranks = range(cfg.world_size) if args.rank is None else [args.rank]
    rows = [{"rank": r, **cfg.coordinates(r),
             **{f"{k}_group": list(cfg.group(k, r).rank_group) for k in kinds},
             **{f"{k}_rank_in_group": cfg.group(k, r).rank_in_group for k in kinds}} for r in ranks]
    if args.json:
        print(json.dumps({"layout": cfg.label(), "groups": {k: [list(g) for g in cfg.groups(k)] for k in kinds},
                          "ranks": rows}, indent=2))
        return 0
    print(f"{cfg.label()} (world size {cfg.world_size}; ranks laid out as [DP, PP, PCP, TP], TP fastest)")
    for k in kinds:
        print(f"{k} groups: {' '.join(str(list(g)) for g in cfg.groups(k))}")
    print()
    print("| rank | " + " | ".join("pp (stage)" if d == "pp" else d for d in dims) + " | "
          + " | ".join(f"{k} group (index)" for k in kinds) + " |")
    print("|---:|" + "---:|" * len(dims) + "|".join(":---" for _ in kinds) + "|")
    for r in rows:
        cells = [f"{r[f'{k}_group']} ({r[f'{k}_rank_in_group']})" for k in kinds]
        print(f"| {r['rank']} | " + " | ".join(str(r[d]) for d in dims) + " | " + " | ".join(cells) + " |")
    return 0


def main(argv: list[str]) -> int:
    try:
        if argv and argv[0] in ACTIONS:
            return {"memory": run_memory, "ranks": run_ranks}[argv[0]](argv[1:])
        return run_search(argv)
    except (PlanError, ValueError, FileNotFoundError) as err:
        print(f"stagewise plan: {err}", file=sys.stderr)
        return 2

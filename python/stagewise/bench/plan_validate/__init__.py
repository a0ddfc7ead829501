"""``stagewise plan validate MODEL --stages 1 2 3``: run the real pipeline for each stage count and
batch, predict the same runs from a device profile, and compare (the planner's side is
:mod:`stagewise.planner.validate`). Results go to ``<out>/<device>-plan-validate.{json,md}`` (default
out: a new folder ``bench/results/<device>-<date>``) and, as the planner's latest validation, to
``planner/validation.json``. ``--tp`` and ``--dcp`` add cells of stages split over rank processes
(every allowed (stages, tp, dcp); a (tp, dcp) the model's heads do not allow is skipped, saying
why); ``--heads Q/KV`` runs a GGUF model regrouped into other heads (:func:`regrouped_model`), for
TP/DCP sizes its own heads do not allow (SmolLM2's 9 / 3: ``--heads 8/1`` for tp 2 and dcp 2;
:mod:`stagewise.bench.regroup`); ``--kv-cache-dtype int8`` (or ``fp8_e4m3``) runs every cell's
pipeline with a compact KV cache and prices it so, its record saying which. The runs:
:mod:`~stagewise.bench.plan_validate.runs`; the comparison with a device profile's prediction:
:mod:`~stagewise.bench.plan_validate.compare`; with ``--partition measured``, a measured split's:
:mod:`~stagewise.bench.plan_validate.split`. With ``--tiny`` (or ``STAGEWISE_BENCH_TINY=1``) it runs
at toy sizes (16 prompt and 4 new tokens, one repeat unless given, the profile measured quickly) to
check that the command works, and keeps the planner's validation record as it is: toy numbers must
not become the planner's expected error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stagewise.bench.options import tiny_from_environment
from stagewise.kv.cache import KV_CACHE_DTYPES


def main(argv: list[str]) -> int:
    """``stagewise plan validate`` (``argv``: what follows it); the exit status."""
    try:
        return _run(argv)
    except (ValueError, FileNotFoundError) as err:
        print(f"stagewise plan validate: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagewise plan validate",
                                description="Run the real pipeline and compare with the planner's prediction.")
    p.add_argument("model", help="a checkpoint stagewise can run (smollm2-135m, a folder, a .gguf)")
    p.add_argument("--stages", type=int, nargs="+", default=[1])
    p.add_argument("--tp", type=int, nargs="+", default=[1],
                   help="tensor-parallel ranks per stage, each a process (default 1); every stage count runs at each")
    p.add_argument("--dcp", type=int, nargs="+", default=[1],
                   help="of a stage's TP ranks, how many shard each KV head's sequence (default 1); a (tp, dcp) the "
                        "model does not allow is skipped, saying why")
    p.add_argument("--heads", default=None, metavar="Q/KV",
                   help="run a GGUF model (e.g. smollm2-135m) regrouped into Q query and KV key-value heads of "
                        "hidden/Q dims, every other tensor as it is: for TP/DCP sizes its own heads do not allow "
                        "(SmolLM2: 8/1 allows tp 2 and dcp 2); tokens are meaningless, timings keep its shapes")
    p.add_argument("--transport", default=None, help="the runtime's transport between stages (e.g. tcp)")
    p.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto",
                   help="what every cell's pipeline stores K/V as (Pipeline(kv_cache_dtype=...)), and the prediction "
                        "prices: auto, the activations' dtype (default); int8 or fp8_e4m3, one-byte codes with a "
                        "float16 scale per token and KV head")
    p.add_argument("--partition", choices=["measured"], default=None,
                   help="measured: check the prediction of --partition measured (each stage's node measured, the "
                        "layers split by it) against the run on that split, at batch 1 (bench/plan_validate/split.py)")
    p.add_argument("--stage-threads", default=None, metavar="T,T,...",
                   help="with --partition measured: each stage's torch threads, dealt in turn (default --threads)")
    p.add_argument("--remeasure", action="store_true",
                   help="with --partition measured: measure each node again rather than read its cached profile")
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
    return p


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    import torch

    from stagewise.bench import report
    from stagewise.bench.plan_validate.compare import stage_layouts
    from stagewise.bench.regroup import regrouped_model
    from stagewise.model.loader import open_checkpoint

    log = (lambda line: print(line, file=sys.stderr, flush=True))
    args.tiny = args.tiny or tiny_from_environment(log)
    for name, full, tiny in (("input_length", 128, 16), ("output_length", 32, 4), ("repeats", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)

    if min(args.stages) < 1 or min(args.batch) < 1 or args.input_length < 1 or args.output_length < 2 or args.repeats < 1:
        raise ValueError("--stages, --batch, --input-length, --repeats must be >= 1 and --output-length >= 2")
    if min(args.tp) < 1 or min(args.dcp) < 1:
        raise ValueError("--tp and --dcp must be >= 1")
    model_note, model_name = "", args.model
    if args.heads:
        model_name = f"{args.model} --heads {args.heads}"
        args.model, model_note = regrouped_model(args.model, args.heads, log=log)
    ckpt = open_checkpoint(args.model)
    config = ckpt.config
    layouts, skipped = stage_layouts(config, args.tp, args.dcp)
    for tp, dcp, why in skipped:
        log(f"skipping tp={tp} dcp={dcp}: {why}")
    if not layouts:
        raise ValueError("no (tp, dcp) of --tp and --dcp that the model allows")
    torch.set_num_threads(args.threads)
    info = report.machine_info("cpu")
    args.out = args.out if args.out is not None else report.default_out(info["device"])
    if args.partition == "measured":
        from stagewise.bench.plan_validate import split

        return split.run(args, ckpt, info, model_name, log)
    for given, flag in ((args.stage_threads is not None, "--stage-threads"), (args.remeasure, "--remeasure")):
        if given:
            raise ValueError(f"{flag} applies to --partition measured")
    from stagewise.bench.plan_validate import compare

    return compare.run(args, ckpt, info, model_name, model_note, layouts, skipped, log)

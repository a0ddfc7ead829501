"""What loads the model and lays it out, for ``generate`` and ``serve``: the arguments, their checks
(those that need no model, then those its config decides), and the pipeline they ask for, started
or attached to."""

from __future__ import annotations

import argparse
import os
import sys

from stagewise.cli.prompt_args import PromptBatch, config_problems, encode_texts
from stagewise.parallel.plan_options import LAUNCHERS, PLACEMENTS, speculative_problems, tpot_target_problem
from stagewise.transport.registry import TRANSPORTS


def add_model_arguments(parser: argparse.ArgumentParser, max_restarts: int = 0, server: bool = False) -> None:
    """What loads the model and lays it out (shared by ``generate`` and ``serve``, whose default
    ``--max-restarts`` and ``--threads`` differ)."""
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--linear-precision", default="exact", choices=["exact", "int8"],
                        help="linears: exact float32 maths (default) or int8 activations over the GGUF blocks, or "
                             "over Q8_0 blocks quantised at load for a dense float32 checkpoint (approximate, "
                             "faster on the CPU; tokens may differ from the exact model's)")
    parser.add_argument("--max-num-seqs", type=int, default=32, metavar="N", help="requests run at once")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch CPU threads of each process that computes: the model's own process, or each "
                             "stage rank (default: OMP_NUM_THREADS, else the cores; stage ranks share them out"
                             + ("; the model in the server's own process: every core for a step of several "
                                "tokens, one fewer for a step of one, between which the HTTP loop writes "
                                "the token)" if server else ")"))
    parser.add_argument("--max-prefill-tokens", type=int, default=8192, metavar="N",
                        help="prompt tokens per step (default 8192): a longer prompt is prefilled in chunks of N "
                             "while other requests decode (chunked prefill)")
    parser.add_argument("--tpot-target", type=float, default=None, metavar="MS",
                        help="a time per output token, in milliseconds, that running requests keep while new "
                             "prompts start: those wait, or run in chunks, for what the running ones can spare "
                             "(default: none, prompts start as soon as they fit)")
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="compute every prompt from its first token (default: a prompt's beginning that "
                             "earlier requests computed reuses their KV, on every stage)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8_e4m3"),
                        help="what the KV cache stores: auto (the activations' dtype), or int8 / fp8_e4m3 codes "
                             "with a float16 scale per token and KV head, read by attention as they are: about a "
                             "quarter of float32's bytes, so a longer context or a larger batch fits (default auto)")
    parser.add_argument("--speculative", default=None, metavar="METHOD",
                        help="draft tokens and verify them in one step through every stage: ngram (prompt lookup: "
                             "the continuation of the text's latest earlier match); the tokens are those of "
                             "decoding without it, or distributed as them when sampling (default: none)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K",
                        help="with --speculative: most draft tokens per request and step (default 3; fewer while "
                             "drafts are rejected)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="most tokens (prompt + generated) per request; default: the model's")
    pp = parser.add_argument_group("pipeline (stages as processes)")
    pp.add_argument("--stages", type=int, default=1, metavar="S", help="pipeline stages, one process each")
    pp.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor-parallel ranks per stage, one process each (N must split the attention heads)")
    pp.add_argument("--dcp", type=int, default=1, metavar="N",
                    help="decode context parallel: N of the TP ranks holding one KV head shard its sequence")
    pp.add_argument("--pcp", type=int, default=1, metavar="N",
                    help="prefill context parallel: N ranks per TP rank, each a part of every prompt")
    pp.add_argument("--partition", default=None, metavar="P",
                    help="with --stages: even (default) | ceil | balanced | measured (each stage's node timed first, "
                         "the layers split by its speed) | explicit ranges such as 0-10,10-22,22-30")
    pp.add_argument("--remeasure", action="store_true",
                    help="with --partition measured: time each stage's node again instead of reading the profile "
                         "cached for it")
    pp.add_argument("--transport", default=None, choices=TRANSPORTS,
                    help="with --stages: how stages pass activations (auto, the default: shared memory on one "
                         "host, tcp across hosts)")
    pp.add_argument("--no-checksum", action="store_true", help="skip frame checksums (on by default)")
    pp.add_argument("--auth-token", default=None, metavar="TOKEN",
                    help="shared secret for stage connections (default: $STAGEWISE_AUTH_TOKEN)")
    pp.add_argument("--max-restarts", type=int, default=max_restarts, metavar="N",
                    help="when a stage process dies or hangs, start the stages again and resume the running "
                         f"requests, up to N times (default {max_restarts}; 0: the requests end with an error)")
    add_tls_arguments(pp)
    pp.add_argument("--launcher", default="local", choices=LAUNCHERS,
                    help="where the processes start: here (local, the default) or as actors on a Ray cluster (ray)")
    pp.add_argument("--ray-address", default=None, metavar="ADDR",
                    help="with --launcher ray: the cluster (default $RAY_ADDRESS, else a Ray instance for this run)")
    pp.add_argument("--placement", default=None, choices=PLACEMENTS,
                    help="with --launcher ray: spread (default; a stage a node where it can), pack (as few nodes "
                         "as fit) or strict_spread (a node each)")
    pp.add_argument("--trace", default=None, metavar="FILE.json",
                    help="write a Chrome-trace timeline of the stages (open in Perfetto)")
    mh = parser.add_argument_group("stages already running (see docs/multi-host.md)")
    mh.add_argument("--plan", default=None, metavar="PLAN.yaml",
                    help="attach to the stages of this run plan instead of starting any")
    mh.add_argument("--store", default=None, metavar="HOST:PORT",
                    help="with --plan: read the stages' addresses from torch.distributed's store (torchrun's "
                         "MASTER_ADDR:MASTER_PORT) instead of the plan's listen addresses")
    mh.add_argument("--connect-timeout", type=float, default=60.0, metavar="S",
                    help="with --plan: how long to wait for the stages (default 60)")
    mh.add_argument("--rejoin-timeout", type=float, default=None, metavar="S",
                    help="with --plan and --max-restarts: how long a broken pipeline waits for each of its stages "
                         "to come back at its address (default 120; see `stagewise stage --rejoin`)")


def add_tls_arguments(group) -> None:
    group.add_argument("--tls-cert", default=None, metavar="PEM",
                       help="mutual TLS on the TCP links between hosts: this host's certificate (with --tls-key and "
                            "--tls-ca, paths valid on every host)")
    group.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    group.add_argument("--tls-ca", default=None, metavar="PEM", help="the CA every peer's certificate must chain to")


def tls_from_args(args: argparse.Namespace) -> dict | None:
    given = {k: getattr(args, f"tls_{k}", None) for k in ("cert", "key", "ca")}
    return given if all(given.values()) else None


def tls_problems(args: argparse.Namespace) -> list[str]:
    given = [k for k in ("cert", "key", "ca") if getattr(args, f"tls_{k}", None)]
    if given and len(given) < 3:
        return ["--tls-cert, --tls-key and --tls-ca go together (mutual TLS needs all three)"]
    return [f"--tls-{k} {getattr(args, f'tls_{k}')}: no such file" for k in given
            if not os.path.isfile(getattr(args, f"tls_{k}"))]


def model_problems(args: argparse.Namespace) -> list[str]:
    """Every problem of :func:`add_model_arguments`' arguments that needs no model."""
    problems: list[str] = []
    if (args.model is None) == (args.plan is None):
        problems.append("give a model, or --plan PLAN to attach to running stages (not both)")
    if args.store and not args.plan:
        problems.append("--store needs --plan")
    for flag in ("stages", "tp", "dcp", "pcp"):
        if args.plan and getattr(args, flag) != 1:
            problems.append(f"--{flag} starts local processes; with --plan the plan's stages are used")
    if args.plan and args.max_prefill_tokens != 8192:
        problems.append("--max-prefill-tokens is the scheduler's of stage 0; with --plan give max_prefill_tokens "
                        "in the plan")
    if args.plan and not args.prefix_cache:
        problems.append("--no-prefix-cache is the scheduler's of stage 0; with --plan give prefix_cache: false in "
                        "the plan")
    if args.plan and args.kv_cache_dtype != "auto":
        problems.append("--kv-cache-dtype is every stage's; with --plan give kv_cache_dtype in the plan")
    if args.plan and args.tpot_target is not None:
        problems.append("--tpot-target is the scheduler's of stage 0; with --plan give tpot_target_ms in the plan")
    if (why := tpot_target_problem(args.tpot_target, "--tpot-target")) is not None:
        problems.append(why)
    if args.plan and (args.speculative is not None or args.num_speculative_tokens != 3):
        problems.append("--speculative is the scheduler's of stage 0; with --plan give speculative and "
                        "num_speculative_tokens in the plan")
    problems += ["--" + p.replace("_", "-", 2) if p.startswith("num_") else "--" + p
                 for p in speculative_problems(args.speculative, args.num_speculative_tokens)]
    if args.plan and args.threads is not None:
        problems.append("--threads is the stage processes'; with --plan give threads per stage in the plan")
    for name, value in (("--max-num-seqs", args.max_num_seqs), ("--max-prefill-tokens", args.max_prefill_tokens),
                        ("--threads", args.threads),
                        ("--stages", args.stages), ("--tp", args.tp),
                        ("--dcp", args.dcp), ("--pcp", args.pcp), ("--max-model-len", args.max_model_len)):
        if value is not None and value < 1:
            problems.append(f"{name} must be >= 1, got {value}")
    if args.max_restarts < 0:
        problems.append(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.rejoin_timeout is not None and (args.rejoin_timeout <= 0 or not args.plan):
        problems.append(f"--rejoin-timeout must be > 0 seconds, got {args.rejoin_timeout}" if args.plan else
                        "--rejoin-timeout applies to stages attached with --plan")
    if args.tp >= 1 and args.dcp >= 1 and args.tp % args.dcp:
        problems.append(f"--dcp {args.dcp} must divide --tp {args.tp} (DCP shards the KV inside the TP group)")
    local_pipeline = args.stages * args.tp * args.pcp > 1 and not args.plan
    if args.remeasure and args.partition != "measured":
        problems.append("--remeasure applies to --partition measured")
    for flag, given in (("--partition", args.partition is not None), ("--transport", args.transport is not None),
                        ("--no-checksum", args.no_checksum), ("--trace", args.trace is not None),
                        ("--launcher", args.launcher != "local")):
        if given and not local_pipeline and not (flag == "--trace" and args.plan):
            problems.append(f"{flag} applies to processes (--stages, --tp or --pcp > 1)"
                            f"{' or --plan' if flag == '--trace' else ''}")
    problems += tls_problems(args)
    if tls_from_args(args) and not local_pipeline:
        problems.append("--tls-cert/--tls-key/--tls-ca apply to processes (--stages, --tp or --pcp > 1); with "
                        "--plan give tls in the plan")
    for flag, given in (("--ray-address", args.ray_address), ("--placement", args.placement)):
        if given is not None and args.launcher != "ray":
            problems.append(f"{flag} applies to --launcher ray")
    return problems


def config_checks(args: argparse.Namespace, batch: PromptBatch, max_new_tokens: int) -> list[str]:
    """What the model's config rules out of these arguments (its config only: nothing is loaded)
    for ``batch`` asking up to ``max_new_tokens`` each; with ``--plan``, what is wrong with the
    plan (as ``launch`` and ``doctor`` name it)."""
    if args.model is None:
        if not args.plan:
            return []
        from stagewise.launch.multihost import load_plan

        try:
            load_plan(args.plan)
        except (ValueError, FileNotFoundError, KeyError, OSError) as err:
            return [str(err)]
        return []
    try:
        from stagewise.model.loader import open_checkpoint

        checkpoint = open_checkpoint(args.model)
        config = checkpoint.config
    except (ValueError, FileNotFoundError, OSError) as err:
        return [f"cannot open {args.model!r}: {err}"]
    try:
        encoded = encode_texts(checkpoint, batch, args)
    except ValueError as err:  # a chat template that refuses the prompt
        return [str(err)]
    problems = config_problems(config, batch, args, max_new_tokens=max_new_tokens, max_model_len=args.max_model_len,
                               stages=args.stages, partition=args.partition, encoded=encoded)
    from stagewise.model.shapes import parallel_problems

    return problems + [f"--tp {args.tp} --dcp {args.dcp}: {p}" for p in parallel_problems(config, args.tp, args.dcp)]


def open_pipeline(args: argparse.Namespace, prog: str):
    """The pipeline :func:`add_model_arguments`' arguments ask for (started, or attached to with
    ``--plan``); None, with the reason printed, when it cannot be had."""
    return _attach(args, prog) if args.plan else _load(args, prog)


def _attach(args: argparse.Namespace, prog: str):
    from stagewise.api import Pipeline

    token = args.auth_token or os.environ.get("STAGEWISE_AUTH_TOKEN") or None
    try:
        return Pipeline.attach(args.plan, store=args.store, auth_token=token, connect_timeout=args.connect_timeout,
                               max_restarts=args.max_restarts,
                               **({} if args.rejoin_timeout is None else {"rejoin_timeout": args.rejoin_timeout}))
    except (ValueError, FileNotFoundError, KeyError, RuntimeError, TimeoutError, OSError) as err:
        print(f"{prog}: cannot attach to the stages of {args.plan!r}: {err}", file=sys.stderr)
        return None


def _load(args: argparse.Namespace, prog: str):
    from stagewise.api import Pipeline
    from stagewise.launch import LaunchError

    # Loading takes seconds; show a progress bar on a terminal (stderr, so piped output stays clean).
    chatty = sys.stderr.isatty()
    bar = _LoadBar(f"stagewise: loading {args.model} on {args.device}") if chatty else None
    options = {}
    if args.stages * args.tp * args.pcp > 1:
        options = dict(partition=args.partition or "even", transport=args.transport or "auto",
                       checksum=not args.no_checksum,
                       auth_token=args.auth_token or os.environ.get("STAGEWISE_AUTH_TOKEN") or None,
                       max_restarts=args.max_restarts)
        bar = None  # the stages load in their own processes
        if args.threads is not None:
            options["threads"] = args.threads
        if args.remeasure:
            options["remeasure"] = True
        if tls_from_args(args):
            options["tls"] = tls_from_args(args)
        if args.launcher != "local":
            options.update(launcher=args.launcher, ray_address=args.ray_address, placement=args.placement or "spread")
    elif args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        try:
            pipe = Pipeline(args.model, stages=args.stages, tp=args.tp, dcp=args.dcp, pcp=args.pcp,
                            device=args.device, dtype=args.dtype,
                            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                            max_prefill_tokens=args.max_prefill_tokens, tpot_target_ms=args.tpot_target,
                            prefix_cache=args.prefix_cache, kv_cache_dtype=args.kv_cache_dtype,
                            speculative=args.speculative,
                            num_speculative_tokens=args.num_speculative_tokens, load_progress=bar,
                            linear_precision=args.linear_precision, **options)
        finally:  # before any message, so that the bar's line is finished first
            if bar is not None:
                bar.close()
    except LaunchError as err:  # the launcher's own failure (a cluster, its resources): the model is fine
        print(f"{prog}: {err}", file=sys.stderr)
        return None
    except (ValueError, FileNotFoundError, KeyError, RuntimeError, TimeoutError, OSError, NotImplementedError) as err:
        print(f"{prog}: cannot load {args.model!r}: {err}", file=sys.stderr)
        return None
    if chatty:
        print(f"stagewise: loaded {args.model} in {pipe.load_s:.1f} s ({pipe.config.num_layers} layers, "
              f"{str(pipe.dtype).removeprefix('torch.')})", file=sys.stderr)
    return pipe


class _LoadBar:
    """A tqdm bar on stderr over the tensors read; the bytes read so far are shown after it."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.bar = None

    def __call__(self, done: int, total: int, nbytes: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.description, unit="tensor", file=sys.stderr)
        self.bar.set_postfix_str(f"{nbytes / 2**20:.0f} MiB", refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

"""One stage rank from ``stagewise stage``'s arguments, run in the calling process: the argument
definitions, the plan, stage and rank they name, and the stage (or the preflight probe) ready to
run. ``stagewise stage`` (:mod:`stagewise.cli.stage`) runs it as a process of its own; a Ray actor
(:mod:`stagewise.launch.ray_cluster`) runs it in a thread of the actor, from the same arguments."""

from __future__ import annotations

import argparse
import json
import os
import threading

from stagewise import startup_gc
from stagewise.launch.multihost import load_plan
from stagewise.parallel.runplan import RunPlan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--plan", help="run plan (YAML/JSON) naming every stage")
    source.add_argument("--plan-json", metavar="JSON", help="the run plan itself, as JSON (what 'stagewise launch' "
                        "prints, so that no file needs copying)")
    parser.add_argument("--stage", type=int, default=None, help="this process's stage index")
    parser.add_argument("--rank", type=int, default=0,
                        help="this process's rank in its stage (0, the leader, unless the stage has tp * pcp ranks)")
    parser.add_argument("--torchrun", action="store_true",
                        help="under torchrun: the stage index is RANK, and the listen address is published in "
                             "torch.distributed's store at MASTER_ADDR:MASTER_PORT")
    parser.add_argument("--listen", default=None, help="HOST:PORT to listen on (default: the plan's)")
    parser.add_argument("--auth-token", default=None,
                        help="shared secret for the hello (default: $STAGEWISE_AUTH_TOKEN)")
    parser.add_argument("--rejoin", type=float, default=0.0, metavar="SECONDS",
                        help="when the pipeline breaks (a neighbour or the driver lost), keep the layers loaded, "
                             "drop every request's KV and wait this long for a driver to connect again, instead "
                             "of exiting (not with the torch transport, whose one world over the run cannot take "
                             "a new member; default 0: exit)")
    parser.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true",
                        help="instead of the stage, the preflight probe `stagewise doctor` talks to (binds the "
                             "stage's address, reads no weights)")


def parse(argv: list[str]) -> argparse.Namespace:
    """``stagewise stage``'s arguments (``argv`` without the program and ``stage``)."""
    parser = _Parser(prog="stagewise stage")
    add_arguments(parser)
    return parser.parse_args(argv)


class _Parser(argparse.ArgumentParser):
    """Bad arguments raise ValueError (in a Ray actor: the driver reads it) instead of exiting."""

    def error(self, message: str):
        raise ValueError(f"stagewise stage: {message}")


def prepare(args: argparse.Namespace, announce=None):
    """The stage (or probe) that ``args`` name, not started: ``(run, stop)``. ``run()`` serves in
    the calling thread and returns the exit code (it raises on failure); ``stop()``, from another
    thread, ends it. ``announce(host, port)``: once it listens (default: the line on stdout)."""
    from stagewise.pipeline.lines import print_listening

    token = args.auth_token or os.environ.get("STAGEWISE_AUTH_TOKEN") or None
    announce = announce or print_listening
    plan, index, rank, on_listening = stage_from_args(args)
    if args.probe:
        from stagewise.launch.probe import serve_probe

        startup_gc.settle()  # nothing loads
        done = threading.Event()
        return (lambda: serve_probe(plan, index, rank, args.listen, token=token, announce=announce, done=done),
                done.set)
    if args.rejoin < 0:
        raise ValueError(f"--rejoin must be >= 0 seconds, got {args.rejoin}")
    from stagewise.pipeline.process import StageProcess

    stage = StageProcess(plan, index, rank=rank, listen=args.listen, auth_token=token, rejoin_s=args.rejoin)
    stage.on_listening, stage.announce = on_listening, announce
    return stage.run, stage.stop


def stage_from_args(args) -> tuple[RunPlan, int, int, object]:
    """``stagewise stage``'s plan, stage index, stage rank and on-listening hook from its
    arguments (``--plan`` or ``--plan-json``; ``--stage`` and ``--rank``, or ``--torchrun``)."""
    if args.plan_json is not None:
        try:
            data = json.loads(args.plan_json)
        except json.JSONDecodeError as err:
            raise ValueError(f"run plan: --plan-json is not valid JSON: {err}") from None
        plan = load_plan(data, need_model=False)
    else:
        plan = load_plan(args.plan, need_model=False)
    if args.torchrun:
        from stagewise.launch.torchrun import publish, torchrun_stage

        plan, index, rank = torchrun_stage(plan, args.stage)

        def on_listening(stage) -> None:
            stage.store = publish(stage, timeout_s=stage.driver_timeout_s)  # kept: stage 0 may host it

        return plan, index, rank, on_listening
    if args.stage is None:
        raise ValueError("stagewise stage: give --stage I (or --torchrun, which takes it from RANK)")
    return plan, args.stage, args.rank, None

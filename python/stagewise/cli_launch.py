"""``stagewise launch PLAN``: start the stages of a run plan on their hosts, then drive them.

Without ``--ssh`` it prints the command each host must run (and waits for those stages to accept
the driver); with ``--ssh`` it runs them over ssh itself. Then, as the driver, it generates for
the prompt arguments (``--prompt``, ``--prompt-ids``, ``--prompt-file``), or for each line read
from stdin (each answer printed under ``--- line N``), and stops the stages at the end. The
plan's ``sampling`` section gives the defaults of the sampling options. See docs/multi-host.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from stagewise.cli_doctor import how
from stagewise.cli_generate import add_tls_arguments, generate_and_print, tls_from_args, tls_problems
from stagewise.cli_prompts import Requests, add_prompt_arguments, read_requests, report, sampling_args, sampling_problems
from stagewise.cli_serve import add_server_arguments, serve_closing, server_problems
from stagewise.parallel.plan_options import LAUNCHERS, PLACEMENTS

PROG = "stagewise launch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.yaml", help="run plan: model, and per stage host, listen, layers")
    parser.add_argument("--ssh", action="store_true", help="run each stage on its host with ssh")
    parser.add_argument("--ssh-command", default="ssh", metavar="CMD",
                        help="ssh client and its options, as shell words (default: ssh; BatchMode=yes is added)")
    parser.add_argument("--remote-command", default="stagewise", metavar="CMD",
                        help="how the hosts run stagewise, as shell words (default: stagewise; e.g. "
                             "'/opt/venv/bin/python -m stagewise.cli')")
    parser.add_argument("--remote-plan", default=None, metavar="PATH",
                        help="hosts read the plan from PATH (copy it there) instead of getting it inline")
    parser.add_argument("--print-only", action="store_true", help="print the commands and exit")
    parser.add_argument("--no-preflight", action="store_true",
                        help="with --ssh or --launcher ray: start the stages without first running `stagewise "
                             "doctor`'s checks")
    add_tls_arguments(parser)
    parser.add_argument("--launcher", default=None, choices=LAUNCHERS,
                        help="ray: place the stages on a Ray cluster as actors (default: the plan's launcher; "
                             "local prints the commands, or runs them with --ssh)")
    parser.add_argument("--ray-address", default=None, metavar="ADDR",
                        help="with --launcher ray: the cluster (default $RAY_ADDRESS, else a Ray instance for this run)")
    parser.add_argument("--placement", default=None, choices=PLACEMENTS,
                        help="with --launcher ray: spread, pack or strict_spread (default: the plan's, spread)")
    parser.add_argument("--auth-token", default=None, metavar="TOKEN",
                        help="shared secret for every connection (default: $STAGEWISE_AUTH_TOKEN)")
    parser.add_argument("--connect-timeout", type=float, default=600.0, metavar="S",
                        help="how long to wait for the stages to start (default 600)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="when a stage dies or hangs, resume the running requests on the stages started again, "
                             "up to N times (default 0: the requests end with an error): with --ssh or --launcher "
                             "ray the lost stages are started again on their hosts; printed commands get --rejoin and "
                             "the lost ones are waited for (their host starts them again)")
    parser.add_argument("--rejoin-timeout", type=float, default=None, metavar="S",
                        help="with --max-restarts and printed commands: how long to wait for each stage to come back "
                             "(default 120)")
    add_prompt_arguments(parser)
    parser.add_argument("--serve", action="store_true",
                        help="answer OpenAI-compatible HTTP requests (as `stagewise serve`) instead of prompts")
    add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from stagewise.launch.multihost import check_plan, load_plan, printed_command

    interactive = not args.prompt and not args.prompt_ids and not args.prompt_file
    problems: list[str] = []
    req = Requests() if interactive else read_requests(args, problems)
    problems += sampling_problems(sampling_args(args)) + tls_problems(args)
    if args.max_restarts < 0:
        problems.append(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.rejoin_timeout is not None and not args.rejoin_timeout > 0:
        problems.append(f"--rejoin-timeout must be > 0 seconds, got {args.rejoin_timeout}")
    if args.serve:
        problems += server_problems(args)
        if not interactive:
            problems.append("--serve answers HTTP requests; leave out --prompt, --prompt-ids and --prompt-file")
    if problems:
        return report(PROG, problems)
    token = args.auth_token or os.environ.get("STAGEWISE_AUTH_TOKEN") or None
    program = shlex.split(args.remote_command)
    try:
        plan = load_plan(args.plan, need_model=not args.print_only)
        if tls_from_args(args):  # the flags name this host's files; the plan's paths are every host's
            import dataclasses

            plan = dataclasses.replace(plan, tls=tls_from_args(args)).validated()
        ray = (args.launcher or plan.launcher) == "ray"
        if ray and (args.ssh or args.print_only):
            raise ValueError("the Ray launcher starts the stages itself: leave out --ssh and --print-only")
        if not ray and (args.ray_address or args.placement):
            raise ValueError("--ray-address and --placement apply to --launcher ray (or launcher: ray in the plan)")
        check_plan(plan, fixed_ports=not (args.ssh or ray))
        if plan.partition == "measured" and not (ray or args.ssh) and not args.print_only:
            raise ValueError("partition measured times each stage's node first: start the stages with --ssh or "
                             "--launcher ray")
    except (ValueError, FileNotFoundError, KeyError, OSError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    from stagewise.launch.start import REJOIN_ARGS, rejoins

    procs = None
    launcher, options = how(plan, args)  # the same launcher and options `stagewise doctor` would use
    if launcher == "local" or args.print_only:
        launcher = None  # printed commands: the stages are started by hand
    extra = REJOIN_ARGS if rejoins(plan, args.max_restarts > 0, launched=launcher is not None) else ()
    if launcher is not None:
        from stagewise.launch.start import start_stages

        if not args.no_preflight and not _preflight(plan, launcher, options, args.connect_timeout):
            return 1
        if plan.partition == "measured":
            from stagewise.launch.measured import measured_plan
            from stagewise.model.loader import open_checkpoint

            plan = measured_plan(plan, open_checkpoint(plan.model),
                                 lambda p, **kw: start_stages(p, launcher, **options, **kw),
                                 token=options.get("auth_token"))
        print(f"{PROG}: starting {plan.num_stages} stages " + ("on a Ray cluster" if ray else "over ssh"),
              file=sys.stderr)
        try:
            procs, plan, addresses = start_stages(plan, launcher, timeout_s=args.connect_timeout, extra=extra,
                                                  **options)
        except (RuntimeError, TimeoutError, OSError, ValueError) as err:
            print(f"{PROG}: {err}", file=sys.stderr)
            return 1
    else:
        out = sys.stdout if args.print_only else sys.stderr
        if token is not None:
            print("# every host needs STAGEWISE_AUTH_TOKEN set to the same token", file=out)
        for index, rank in plan.members:
            spec = plan.stages[index]
            print(f"# {plan.member_label(index, rank)} on {spec.host}: layers {spec.start_layer}-{spec.end_layer}, "
                  f"listens on {spec.rank_listen(rank)}, device {spec.rank_device(rank)}", file=out)
            print(printed_command(plan, index, rank=rank, auth=token is not None, program=program,
                                  remote_plan=args.remote_plan, extra=extra), file=out)
        if args.remote_plan:
            print(f"# copy {args.plan} to {args.remote_plan} on every host first", file=out)
        if args.print_only:
            return 0
        addresses = None
        print(f"{PROG}: waiting up to {args.connect_timeout:.0f} s for the stages", file=sys.stderr)
    again = None if launcher is None else {"launcher": launcher, "timeout_s": args.connect_timeout,
                                           **{k: v for k, v in options.items() if k != "auth_token"}}
    return _drive(plan, args, req, token=token, addresses=addresses, procs=procs, interactive=interactive,
                  launcher=again)


def _preflight(plan, launcher: str, options: dict, timeout_s: float) -> bool:
    """``stagewise doctor``'s checks before the stages start; the table and False when any fails."""
    from stagewise.launch.doctor import run_doctor, table

    checks, here = run_doctor(plan, launcher, timeout_s=min(timeout_s, 120.0), **options)
    if here or not all(c.ok for c in checks):
        print(f"{PROG}: the preflight failed (--no-preflight skips it):\n{table(checks, plan, here)}", file=sys.stderr)
        return False
    print(f"{PROG}: preflight: {len(checks)} checks passed", file=sys.stderr)
    return True


def _drive(plan, args, req: Requests, *, token, addresses, procs, interactive: bool, launcher: dict | None) -> int:
    from stagewise.api import Pipeline

    try:
        pipe = Pipeline.attach(plan, addresses=addresses, auth_token=token, connect_timeout=args.connect_timeout,
                               processes=procs, max_restarts=args.max_restarts, launcher=launcher,
                               **({} if args.rejoin_timeout is None else {"rejoin_timeout": args.rejoin_timeout}))
    except (ValueError, FileNotFoundError, KeyError, RuntimeError, TimeoutError, OSError) as err:
        if procs is not None:
            procs.stop(grace_s=0.5)
        print(f"{PROG}: cannot connect to the stages: {err}", file=sys.stderr)
        return 1
    print(f"{PROG}: connected to {plan.num_stages} stages", file=sys.stderr)
    if args.serve:
        return serve_closing(pipe, args, PROG)
    if not interactive:
        return generate_and_print(pipe, args, req, prog=PROG)
    code = 0
    try:
        if sys.stdin.isatty():
            print("one prompt per line; Ctrl-D ends", file=sys.stderr)
        for number, line in enumerate(sys.stdin, start=1):
            if not line.strip():
                continue
            one = Requests()
            one.texts, one.overrides, one.lines = [line.rstrip("\n")], [None], [number]
            code = max(code, generate_and_print(pipe, args, one, prog=PROG, close=False, label=f"line {number}"))
    except KeyboardInterrupt:
        code = 130
    finally:
        pipe.close()
    return code

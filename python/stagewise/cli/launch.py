"""``stagewise launch PLAN``: start the stages of a run plan on their hosts, then drive them.

The stages on this machine start here (the local launcher, as ``generate --stages`` starts its
own); for each stage on another host it prints the command that host must run, and waits for
those stages to accept the driver. With ``--ssh`` it runs every stage on its host over ssh, and
with ``--launcher ray`` places them on a Ray cluster. Then, as the driver, it generates for
the prompt arguments (``--prompt``, ``--prompt-ids``, ``--prompt-file``), or for each line read
from stdin (each answer printed under ``--- line N``), and stops the stages at the end. The
plan's ``sampling`` section gives the defaults of the sampling options. See docs/multi-host.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from stagewise.cli.doctor import how
from stagewise.cli.model_args import add_tls_arguments, tls_from_args, tls_problems
from stagewise.cli.output import generate_and_print
from stagewise.cli.prompt_args import PromptBatch, add_prompt_arguments, read_prompts, report
from stagewise.cli.sampling import sampling_args
from stagewise.cli.serve import add_server_arguments, serve_closing, server_problems
from stagewise.engine.params import sampling_problems
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
    parser.add_argument("--print-only", action="store_true",
                        help="print every stage's command (this machine's too) and exit")
    parser.add_argument("--no-preflight", action="store_true",
                        help="with --ssh or --launcher ray: start the stages without first running `stagewise "
                             "doctor`'s checks")
    add_tls_arguments(parser)
    parser.add_argument("--launcher", default=None, choices=LAUNCHERS,
                        help="ray: place the stages on a Ray cluster as actors (default: the plan's launcher; "
                             "local starts the stages on this machine here and prints the others' commands, or "
                             "runs them with --ssh)")
    parser.add_argument("--ray-address", default=None, metavar="ADDR",
                        help="with --launcher ray: the cluster (default $RAY_ADDRESS, else a Ray instance for this run)")
    parser.add_argument("--placement", default=None, choices=PLACEMENTS,
                        help="with --launcher ray: spread, pack or strict_spread (default: the plan's, spread)")
    parser.add_argument("--auth-token", default=None, metavar="TOKEN",
                        help="shared secret for every connection (default: $STAGEWISE_AUTH_TOKEN)")
    parser.add_argument("--connect-timeout", type=float, default=600.0, metavar="S",
                        help="how long to wait for the stages to start: those started here, and those their "
                             "hosts start with the printed commands (default 600)")
    parser.add_argument("--remeasure", action="store_true",
                        help="with partition: measured (in the plan): measure each stage's node again instead of "
                             "reading its cached profile")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="when a stage dies or hangs, resume the running requests on the stages started again, "
                             "up to N times (default 0: the requests end with an error): with --ssh, --launcher "
                             "ray or every stage on this machine the lost stages are started again on their hosts; "
                             "printed commands get --rejoin and the lost ones are waited for (their host starts them "
                             "again)")
    parser.add_argument("--rejoin-timeout", type=float, default=None, metavar="S",
                        help="with --max-restarts and printed commands: how long to wait for each stage to come back "
                             "(default 120)")
    add_prompt_arguments(parser)
    parser.add_argument("--serve", action="store_true",
                        help="answer OpenAI-compatible HTTP requests (as `stagewise serve`) instead of prompts")
    add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from stagewise.launch.here import members_here
    from stagewise.launch.multihost import check_plan, load_plan

    interactive = not args.prompt and not args.prompt_ids and not args.prompt_file
    problems: list[str] = []
    batch = PromptBatch() if interactive else read_prompts(args, problems)
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
        if args.remeasure and plan.partition != "measured":
            raise ValueError(f"--remeasure applies to a plan with partition: measured, got {plan.partition!r}")
        # The launcher and options `stagewise doctor` would use: local when every stage is here.
        launcher, options = how(plan, args)
        if args.print_only:
            launcher = None
        here = members_here(plan) if launcher is None and not args.print_only else []
        check_plan(plan, fixed_ports=launcher is None, started_here={plan.members[i][0] for i in here})
        if plan.partition == "measured" and launcher is None and not args.print_only:
            raise ValueError("partition measured times each stage's node before the layers are split, so this launch "
                             "must start every stage: put them all on this machine, or use --ssh or --launcher ray")
    except (ValueError, FileNotFoundError, KeyError, OSError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    from stagewise.launch.start import REJOIN_ARGS, rejoins

    extra = REJOIN_ARGS if rejoins(plan, args.max_restarts > 0, launched=launcher is not None) else ()
    if launcher is None:
        return _by_hand(plan, args, batch, token=token, here=here, extra=extra, interactive=interactive)
    from stagewise.launch.start import start_stages

    if launcher != "local" and not args.no_preflight and not _preflight(plan, launcher, options,
                                                                         args.connect_timeout):
        return 1
    try:
        if plan.partition == "measured":
            from stagewise.launch.measured import measured_plan
            from stagewise.model.loader import open_checkpoint

            plan = measured_plan(plan, open_checkpoint(plan.model),
                                 lambda p, **kw: start_stages(p, launcher, **options, **kw),
                                 token=options.get("auth_token"), remeasure=args.remeasure)
        where = {"ray": "on a Ray cluster", "ssh": "over ssh", "local": "on this machine"}[launcher]
        print(f"{PROG}: starting {plan.num_stages} stages {where}", file=sys.stderr)
        procs, plan, addresses = start_stages(plan, launcher, timeout_s=args.connect_timeout, extra=extra, **options)
    except (RuntimeError, TimeoutError, OSError, ValueError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    again = {"launcher": launcher, "timeout_s": args.connect_timeout,
             **{k: v for k, v in options.items() if k != "auth_token"}}
    return _drive(plan, args, batch, token=token, addresses=addresses, procs=procs, interactive=interactive,
                  launcher=again)


def _by_hand(plan, args, batch: PromptBatch, *, token, here: list[int], extra, interactive: bool) -> int:
    """Stages started by their hosts from the printed commands (``--print-only``: all of them, and
    nothing more), those on this machine (``here``) started here; then drive them."""
    from stagewise.launch.here import awaited, print_commands, start_here

    away = [i for i in range(len(plan.members)) if i not in here]
    out = sys.stdout if args.print_only else sys.stderr
    if away and not args.print_only:
        print("# on other hosts than this one: run each command below on its host (this launch waits for them)",
              file=out)
    print_commands(plan, away, out, auth=token is not None, program=shlex.split(args.remote_command),
                   remote_plan=args.remote_plan, remote_source=args.plan, extra=extra)
    if args.print_only:
        return 0
    procs, addresses = None, None
    if here:
        print(f"{PROG}: starting {', '.join(plan.member_label(*plan.members[i]) for i in here)} here", file=sys.stderr)
        try:
            procs, addresses = start_here(plan, here, auth_token=token, timeout_s=args.connect_timeout, extra=extra)
        except (RuntimeError, TimeoutError, OSError, ValueError) as err:
            print(f"{PROG}: {err}", file=sys.stderr)
            return 1
    if away:
        by = "its command above on its host" if len(away) == 1 else "the commands above on their hosts"
        print(f"{PROG}: waiting up to {args.connect_timeout:.0f} s for {awaited(plan, away)}, started by {by}",
              file=sys.stderr)
    return _drive(plan, args, batch, token=token, addresses=addresses, procs=procs, interactive=interactive,
                  launcher=None, away=away)


def _preflight(plan, launcher: str, options: dict, timeout_s: float) -> bool:
    """``stagewise doctor``'s checks before the stages start; the table and False when any fails."""
    from stagewise.launch.doctor import run_doctor, table

    checks, here = run_doctor(plan, launcher, timeout_s=min(timeout_s, 120.0), **options)
    if here or not all(c.ok for c in checks):
        print(f"{PROG}: the preflight failed (--no-preflight skips it):\n{table(checks, plan, here)}", file=sys.stderr)
        return False
    print(f"{PROG}: preflight: {len(checks)} checks passed", file=sys.stderr)
    return True


def _drive(plan, args, batch: PromptBatch, *, token, addresses, procs, interactive: bool, launcher: dict | None,
           away: list[int] = ()) -> int:
    """Attach to the stages (``procs``: those started here, watched and stopped with the pipeline;
    ``away``: the members other hosts start) and answer the prompts, stdin's lines or HTTP."""
    from stagewise.api import Pipeline

    try:
        pipe = Pipeline.attach(plan, addresses=addresses, auth_token=token, connect_timeout=args.connect_timeout,
                               processes=procs, max_restarts=args.max_restarts, launcher=launcher,
                               **({} if args.rejoin_timeout is None else {"rejoin_timeout": args.rejoin_timeout}))
    except BaseException as err:
        if procs is not None:
            procs.stop(grace_s=0.5)
        if not isinstance(err, (ValueError, FileNotFoundError, KeyError, RuntimeError, TimeoutError, OSError)):
            raise
        hint = ""
        if away and isinstance(err, OSError):  # not there (yet), or something else answers there
            from stagewise.launch.here import awaited

            one = len(away) == 1
            hint = (f"; start {awaited(plan, away)} on {'its host' if one else 'their hosts'} with the "
                    f"command{'' if one else 's'} printed above, or allow more time (--connect-timeout)")
        print(f"{PROG}: cannot connect to the stages: {err}{hint}", file=sys.stderr)
        return 1
    print(f"{PROG}: connected to {plan.num_stages} stages", file=sys.stderr)
    if args.serve:
        return serve_closing(pipe, args, PROG)
    if not interactive:
        return generate_and_print(pipe, args, batch, prog=PROG)
    code = 0
    try:
        if sys.stdin.isatty():
            print("one prompt per line; Ctrl-D ends", file=sys.stderr)
        for number, line in enumerate(sys.stdin, start=1):
            if not line.strip():
                continue
            one = PromptBatch()
            one.texts, one.overrides, one.lines = [line.rstrip("\n")], [None], [number]
            code = max(code, generate_and_print(pipe, args, one, prog=PROG, close=False, label=f"line {number}"))
    except KeyboardInterrupt:
        code = 130
    finally:
        pipe.close()
    return code

"""``stagewise doctor PLAN``: the checks of a multi-host run (see :mod:`stagewise.launch.doctor`),
one table, exit code 1 when any fails."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from stagewise.parallel.plan_options import LAUNCHERS, PLACEMENTS

PROG = "stagewise doctor"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.yaml", help="the run plan to check")
    parser.add_argument("--ssh", action="store_true", help="start the probes on their hosts with ssh")
    parser.add_argument("--ssh-command", default="ssh", metavar="CMD", help="ssh client and its options (default: ssh)")
    parser.add_argument("--remote-command", default="stagewise", metavar="CMD",
                        help="how the hosts run stagewise, as shell words (default: stagewise)")
    parser.add_argument("--remote-plan", default=None, metavar="PATH",
                        help="hosts read the plan from PATH instead of getting it inline")
    parser.add_argument("--launcher", default=None, choices=LAUNCHERS,
                        help="ray: start the probes as Ray actors, placed as the run would be (default: the plan's)")
    parser.add_argument("--ray-address", default=None, metavar="ADDR", help="with --launcher ray: the cluster")
    parser.add_argument("--placement", default=None, choices=PLACEMENTS, help="with --launcher ray (default: the plan's)")
    parser.add_argument("--auth-token", default=None, metavar="TOKEN",
                        help="the stages' shared secret (default: $STAGEWISE_AUTH_TOKEN), given to the probes' hosts")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="how long to wait for the probes (default 60)")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def how(plan, args: argparse.Namespace) -> tuple[str | None, dict]:
    """The launcher that starts the probes (None: those on other hosts by hand, from printed
    commands, and those on this machine here) and its options."""
    from stagewise.launch.multihost import is_this_machine

    token = args.auth_token or os.environ.get("STAGEWISE_AUTH_TOKEN") or None
    if (args.launcher or plan.launcher) == "ray":
        return "ray", dict(auth_token=token, ray_address=args.ray_address, placement=args.placement or plan.placement)
    if args.ssh:
        return "ssh", dict(auth_token=token, ssh=dict(program=shlex.split(args.remote_command),
                                                      ssh=shlex.split(args.ssh_command), remote_plan=args.remote_plan))
    if all(is_this_machine(host) for host in {s.host for s in plan.stages}):
        return "local", dict(auth_token=token)
    return None, dict(auth_token=token)


def run(args: argparse.Namespace) -> int:
    from stagewise.launch.doctor import as_json, run_doctor, table
    from stagewise.launch.here import members_here
    from stagewise.launch.local import stage_argv
    from stagewise.launch.multihost import load_plan

    try:
        plan = load_plan(args.plan, need_model=False)
    except (ValueError, FileNotFoundError, KeyError, OSError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    launcher, options = how(plan, args)
    here = []
    if launcher is None:  # the probes of this machine's stages start here, the others' on their hosts
        here = members_here(plan)
        print(f"# run on each host, then wait here ({args.timeout:.0f} s):", file=sys.stderr)
        for index, rank in [m for i, m in enumerate(plan.members) if i not in here]:
            argv = stage_argv(plan, index, rank=rank, program=shlex.split(args.remote_command),
                              remote_plan=args.remote_plan, extra=["--probe"])
            print(f"# {plan.member_label(index, rank)} on {plan.stages[index].host}:\n{shlex.join(argv)}",
                  file=sys.stderr)
    checks, model_here = run_doctor(plan, launcher, timeout_s=args.timeout, here=here, **options)
    failed = bool(model_here) or not all(c.ok for c in checks)
    if args.json:
        print(json.dumps({"ok": not failed, "model_here": model_here, "checks": as_json(checks)}, indent=2))
    else:
        print(table(checks, plan, model_here))
    return 1 if failed else 0

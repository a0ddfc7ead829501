"""Stages on many machines: checking a plan for reachability, the command each host runs, and
running those commands over ssh.

The plan travels inside the command (``stagewise stage --plan-json '{...}' --stage I``), so
nothing needs copying to the hosts but the model itself; ``remote_plan`` prints
``--plan PATH`` instead, for operators who distribute the file. The auth token never appears
on a command line: printed commands read ``$STAGEWISE_AUTH_TOKEN``, and over ssh the token is
written to the remote shell's standard input.
"""

from __future__ import annotations

import functools
import ipaddress
import shlex
import socket
import subprocess
from collections.abc import Collection, Sequence

from stagewise.launch.local import StageProcesses, read_addresses, stage_argv
from stagewise.parallel.runplan import RunPlan, StageSpec, parse_address
from stagewise.launch.torchrun import WILDCARD_HOSTS

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")
# Reads the token from the first line of stdin into the environment, then runs the stage.
TOKEN_FROM_STDIN = 'IFS= read -r STAGEWISE_AUTH_TOKEN && export STAGEWISE_AUTH_TOKEN && exec "$@"'


class PlanError(ValueError):
    """A run plan that cannot work across its hosts; the message lists every problem."""


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_this_machine(host: str) -> bool:
    """Loopback, this machine's name, or an address bound on one of its interfaces (in this
    network namespace): binding to it succeeds only then."""
    if is_loopback(host) or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def connect_address(spec: StageSpec, rank: int = 0) -> tuple[str, int]:
    """Where the driver and the previous stage dial rank ``rank`` of stage ``spec``: its listen
    address, or its ``host`` when it listens on every interface."""
    host, port = parse_address(spec.rank_listen(rank), f"stages[{spec.index}].listen")
    return (spec.host if host in WILDCARD_HOSTS else host), port


def check_plan(plan: RunPlan, *, fixed_ports: bool, started_here: Collection[int] = ()) -> None:
    """Raise PlanError naming each stage that its peers (the driver here, the previous stage on
    its host) could not reach. ``fixed_ports``: the driver learns addresses from the plan only
    (printed commands), so port 0 cannot work, except for the stages it starts itself
    (``started_here``, stage indices), which say where they listen."""
    problems: list[str] = []
    n = plan.num_stages
    for spec in plan.stages:
        where = f"stages[{spec.index}]"
        host, port = parse_address(spec.listen, f"{where}.listen")
        dialler = plan.stages[(spec.index - 1) % n]
        if spec.host in WILDCARD_HOSTS:
            problems.append(f"{where}: listens on {spec.listen!r} and has no 'host': give the host "
                            "(name or address) that the others dial")
        elif is_loopback(host):
            if not is_this_machine(spec.host):
                problems.append(f"{where}: runs on {spec.host!r} but listens on loopback {spec.listen!r}, which "
                                "no other machine can reach; listen on that host's address (or 0.0.0.0)")
            elif n > 1 and dialler.host != spec.host and not (is_this_machine(dialler.host)):
                problems.append(f"{where}: listens on loopback {spec.listen!r} but stage {dialler.index} on "
                                f"{dialler.host!r} must dial it")
        if port == 0 and fixed_ports and spec.index not in started_here:
            problems.append(f"{where}: listens on port 0 (any free port); the driver finds stages by the plan, so "
                            "give a fixed port (or use --ssh, or torchrun with --store)")
    seen: dict[tuple[str, int], int] = {}
    for spec in plan.stages:
        address = connect_address(spec)
        if address[1] and address in seen:
            problems.append(f"stages[{spec.index}]: listens on {address[0]}:{address[1]} like stage "
                            f"{seen[address]}; give each stage on a host its own port")
        seen.setdefault(address, spec.index)
    if problems:
        raise PlanError("run plan: " + "; ".join(problems))


def printed_command(plan: RunPlan, index: int, *, rank: int = 0, auth: bool, program: Sequence[str] = ("stagewise",),
                    **options) -> str:
    """One shell line for the operator (rank ``rank`` of stage ``index``); with auth, the token
    comes from the host's environment."""
    line = shlex.join(stage_argv(plan, index, rank=rank, program=program, **options))
    # "$STAGEWISE_AUTH_TOKEN" must stay expandable: appended outside shlex's single quotes.
    return line + (' --auth-token "$STAGEWISE_AUTH_TOKEN"' if auth else "")


def ssh_argv(host: str, argv: Sequence[str], *, auth: bool, ssh: Sequence[str] = ("ssh",),
             ssh_options: Sequence[str] = ("-o", "BatchMode=yes")) -> list[str]:
    """``ssh [options] -- HOST 'quoted command'``: ssh hands the remote shell one string, so each
    argument is shell-quoted; ``--`` ends ssh's options (a host cannot pass for one). With auth,
    the remote ``sh`` reads the token from stdin before running the stage."""
    if not host or host.startswith("-") or any(c.isspace() for c in host):
        raise ValueError(f"stagewise launch: ssh host must be a host name or address, got {host!r}")
    remote = ["sh", "-c", TOKEN_FROM_STDIN, "stagewise-stage", *argv] if auth else list(argv)
    return [*ssh, *ssh_options, "--", host, shlex.join(remote)]


def ssh_spawn(plan: RunPlan, *, auth_token: str | None, program: Sequence[str], ssh: Sequence[str],
              remote_plan: str | None = None, timeout_s: float = 300.0, extra: Sequence[str] = (),
              keep_going: bool = False, members: Sequence[tuple[int, int]] | None = None
              ) -> tuple[StageProcesses, list]:
    """Start every stage on its host over ssh (or only ``members``, (stage, rank) pairs); wait for
    each ``STAGEWISE-LISTENING`` line (ssh forwards the remote stdout) and return the ssh processes
    and the stages' dial addresses. The stages get ``--die-with-parent``: when ssh goes, the remote
    session ends and so do they. The processes start lost ranks again over ssh too."""
    members = plan.members if members is None else list(members)
    again = functools.partial(ssh_spawn, program=program, ssh=ssh, remote_plan=remote_plan, timeout_s=timeout_s)
    procs = StageProcesses([], [plan.member_label(i, r) for i, r in members], spawn=again)
    try:
        for index, rank in members:
            spec = plan.stages[index]
            argv = stage_argv(plan, index, rank=rank, program=program, remote_plan=remote_plan,
                              extra=["--die-with-parent", *extra])
            proc = subprocess.Popen(ssh_argv(spec.host, argv, auth=auth_token is not None, ssh=ssh),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            if auth_token is not None:
                proc.stdin.write(auth_token + "\n")
                proc.stdin.flush()
            proc.stdin.close()
            procs.procs.append(proc)
        addresses = []
        for (index, _), got in zip(members, read_addresses(procs.procs, procs.labels, timeout_s, keep_going)):
            if isinstance(got, str):
                addresses.append(got)
                continue
            host, port = got
            addresses.append((plan.stages[index].host if host in WILDCARD_HOSTS else host, port))
    except BaseException:
        procs.stop(grace_s=0.5)
        raise
    return procs, addresses


def load_plan(source, *, need_model: bool = True) -> RunPlan:
    """A plan from a file path or a parsed document. A plan without per-stage ``layers`` takes
    the layer count from its model (which must then be readable here); ``need_model`` also
    checks the layer ranges against the model."""
    from stagewise.parallel.runplan import read_plan_data
    from stagewise.model.loader import open_checkpoint

    data = source if isinstance(source, dict) else read_plan_data(source)
    if not isinstance(data, dict):
        return RunPlan.from_dict(data)  # raises, naming the problem
    stages, model = data.get("stages"), data.get("model")
    ranges_given = isinstance(stages, list) and all(isinstance(s, dict) and "layers" in s for s in stages)
    if (need_model or not ranges_given) and isinstance(model, str) and model:
        return RunPlan.from_dict(data, open_checkpoint(model).config.num_layers)
    return RunPlan.from_dict(data)

"""A run plan launched without ssh or Ray: the stages on this machine start here, by the local
launcher (as ``stagewise generate --stages`` starts its own, and stopped the same way), and for
each stage on another host the command to run there is printed; the driver then waits for those
at their plan addresses.

A stage is on this machine when its ``host`` is loopback, this machine's name, or an address bound
on one of its interfaces (:func:`~stagewise.launch.multihost.is_this_machine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from stagewise.launch.local import StageProcesses, spawn_stages
from stagewise.launch.multihost import connect_address, is_this_machine, printed_command
from stagewise.launch.torchrun import WILDCARD_HOSTS
from stagewise.parallel.runplan import RunPlan


def members_here(plan: RunPlan) -> list[int]:
    """The indices of :attr:`RunPlan.members` whose stage runs on this machine."""
    here = {host: is_this_machine(host) for host in {s.host for s in plan.stages}}
    return [i for i, (stage, _) in enumerate(plan.members) if here[plan.stages[stage].host]]


def start_here(plan: RunPlan, here: Sequence[int], *, auth_token: str | None, timeout_s: float,
               extra: Sequence[str] = (), keep_going: bool = False) -> tuple[StageProcesses, list]:
    """Start members ``here`` (indices of :attr:`RunPlan.members`) on this machine and wait until
    each listens. Returns the processes (None in the place of every other member) and every
    member's address: where a started one listens, the plan's for the others. On any error every
    process started is stopped, or with ``keep_going`` the error takes that member's address."""
    members = plan.members
    started, got = spawn_stages(plan, auth_token=auth_token, timeout_s=timeout_s, extra=extra,
                                keep_going=keep_going, members=[members[i] for i in here])
    procs: list = [None] * len(members)
    addresses: list = [connect_address(plan.stages[s], r) for s, r in members]
    for i, proc, address in zip(here, started.procs, got, strict=True):
        procs[i] = proc
        if not isinstance(address, str) and address[0] in WILDCARD_HOSTS:  # what the others dial
            address = (plan.stages[members[i][0]].host, address[1])
        addresses[i] = address
    return StageProcesses(procs, [plan.member_label(s, r) for s, r in members]), addresses


def print_commands(plan: RunPlan, which: Sequence[int], out: TextIO, *, auth: bool, program: Sequence[str],
                   remote_plan: str | None = None, remote_source: str | None = None, extra: Sequence[str] = ()) -> None:
    """For members ``which``: a comment naming the rank, its host, layers, address and device, then
    the command its host runs (``printed_command``). ``remote_source``: the plan file to copy to
    ``remote_plan`` on every host."""
    if not which:
        return
    if auth:
        print("# every host needs STAGEWISE_AUTH_TOKEN set to the same token", file=out)
    for i in which:
        index, rank = plan.members[i]
        spec = plan.stages[index]
        print(f"# {plan.member_label(index, rank)} on {spec.host}: layers {spec.start_layer}-{spec.end_layer}, "
              f"listens on {spec.rank_listen(rank)}, device {spec.rank_device(rank)}", file=out)
        print(printed_command(plan, index, rank=rank, auth=auth, program=program, remote_plan=remote_plan,
                              extra=extra), file=out)
    if remote_plan:
        print(f"# copy {remote_source} to {remote_plan} on every host first", file=out)


def awaited(plan: RunPlan, which: Sequence[int]) -> str:
    """``stage 1 at 10.0.0.2:7100 (on 10.0.0.2), ...``: where the driver dials members ``which``."""
    out = []
    for i in which:
        index, rank = plan.members[i]
        host, port = connect_address(plan.stages[index], rank)
        host = f"[{host}]" if ":" in host else host
        out.append(f"{plan.member_label(index, rank)} at {host}:{port} (on {plan.stages[index].host})")
    return ", ".join(out)

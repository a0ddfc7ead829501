"""The process groups of a run: the torch.distributed worlds, and in each a stage's tp, dcp and
pcp groups (numbered by :class:`~stagewise.parallel.ranks.StageRanks`).

A world exists only where something needs it, and spans no more than that:

- a stage of several ranks has a world of its own ranks (:func:`world_ranks`), whose store its
  leader hosts on loopback. A stage's ranks share its leader's host, so neither the store's
  traffic nor gloo's connections leave that host (gloo listens on the loopback interface too):
  a run that asks for TLS between hosts has no plain-text link between them;
- a world transport between stages (``torch``, :mod:`stagewise.transport.registry`; its peers are
  the stages' leaders) needs one world over every rank of the run, whose store stage 0's leader
  hosts (that transport is refused between hosts when the plan asks for TLS:
  :func:`stagewise.pipeline.links.hop_transports`).

Every process of a world creates every group of it, in the same order (torch.distributed's rule
for ``new_group``), and keeps its own.

A group whose ranks are all CPU processes (the ranks of a stage share its leader's host) runs
its collectives over shared memory (:mod:`stagewise.parallel.shm_group`), meeting through the
world's store; ``STAGEWISE_SHM_COLLECTIVES=0`` keeps such groups on gloo.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from stagewise.model.collectives import StageGroups
from stagewise.parallel import comm, shm_group
from stagewise.parallel.runplan import RunPlan
from stagewise.transport import registry

GROUP_ORDER = ("tp", "dcp", "pcp")
SHM_ENV = "STAGEWISE_SHM_COLLECTIVES"


def spans_run(hop_transports: list[str]) -> bool:
    """Whether the run has one world over every rank (a world transport between stages: ``torch``)
    rather than a world per stage of several ranks. That world cannot take a new member, so its
    stages never rejoin a new driver."""
    return any(registry.is_world(hop) for hop in hop_transports)


def world_ranks(plan: RunPlan, stage: int, hop_transports: list[str]) -> list[int]:
    """The run-wide ranks (the plan's rank order) of the world stage ``stage`` joins: every rank of
    the run with the ``torch`` transport, else the stage's own ranks when it has several; empty
    when it joins none. Its first rank hosts the world's store."""
    if spans_run(hop_transports):
        return list(range(plan.world_size))
    ranks = plan.stage_ranks()[stage]
    return list(range(ranks.first, ranks.first + ranks.size)) if ranks.size > 1 else []


def store_host(hop_transports: list[str], leader_host: str) -> str:
    """Where the ranks of a world reach its store: a stage's own world on loopback (its ranks share
    the leader's host; the store listens on nothing else), the run's world (the ``torch``
    transport) at the host its first rank is reached at."""
    return leader_host if spans_run(hop_transports) else "127.0.0.1"


def host_world_store(plan: RunPlan, stage: int, rank: int, hop_transports: list[str],
                     host: str) -> dist.TCPStore | None:
    """The store of stage ``stage``'s world (:func:`world_ranks`), hosted here (a free port: on
    loopback for a stage's own world, on every interface of ``host``'s for the run's), when rank
    ``rank`` of the stage is the world's first rank; None otherwise. The caller keeps it while
    the world lives."""
    world = world_ranks(plan, stage, hop_transports)
    if not world or world[0] != plan.stage_ranks()[stage].first + rank:
        return None
    return comm.host_store(store_host(hop_transports, host))[0]


def join_stage_groups(plan: RunPlan, stage: int, rank: int, store: tuple[str, int] | None,
                      hop_transports: list[str], *, timeout_s: float = comm.DEFAULT_TIMEOUT_S) -> StageGroups:
    """Join stage ``stage``'s world (:func:`world_ranks`) through ``store`` as the stage's rank
    ``rank`` and return that rank's groups (no world: every group is one rank)."""
    world = world_ranks(plan, stage, hop_transports)
    if not world:
        return StageGroups()
    if store is None:
        raise ValueError(f"stage {stage} rank {rank}: the stage's torch.distributed world needs its store")
    all_ranks = plan.stage_ranks()
    devices = [s.rank_device(r) for s, ranks in zip(plan.stages, all_ranks) for r in range(ranks.size)]
    hosts = [s.host for s, ranks in zip(plan.stages, all_ranks) for _ in range(ranks.size)]
    backend = comm.backend_for([devices[w] for w in world], [hosts[w] for w in world])
    me = world.index(all_ranks[stage].first + rank)
    comm.init_world(rank=me, world_size=len(world), store=store, backend=backend, timeout_s=timeout_s,
                    local=not spans_run(hop_transports))
    # A group's ranks are one stage's, on one host: they decide the same (the others ignore it).
    shm = shm_group.available() and os.environ.get(SHM_ENV, "1") != "0"
    meet = None
    mine = {}
    for ranks in all_ranks if len(world) == plan.world_size else [all_ranks[stage]]:
        for kind in GROUP_ORDER:
            for members in ranks.groups(kind):
                members = [world.index(m) for m in members]
                local = (shm and me in members and len(members) > 1
                         and all(torch.device(devices[world[m]]).type == "cpu" for m in members))
                if local and meet is None:
                    client = dist.TCPStore(store[0], int(store[1]), is_master=False,
                                           timeout=timedelta(seconds=timeout_s))
                    meet = dist.PrefixStore("stagewise-shm", client)
                group = comm.Group.new(members, shm_store=meet if local else None,
                                       key=f"{kind}/{'-'.join(map(str, members))}", timeout_s=timeout_s)
                if me in members:
                    mine[kind] = group
    return StageGroups(**mine)

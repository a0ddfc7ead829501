"""The process groups of a run: one torch.distributed world over every rank of every stage, and in
it each stage's tp, dcp and pcp groups (numbered by :class:`~stagewise.parallel.ranks.StageRanks`).

Every process of the run creates every group, in the same order (torch.distributed's rule for
``new_group``), and keeps its own. The world exists only when something needs it: a stage of
several ranks, or the ``torch`` transport between stages (whose peers are the stages' leaders).

A group whose ranks are all CPU processes (the ranks of a stage share its leader's host) runs
its collectives over shared memory (:mod:`stagewise.parallel.shm_group`), meeting through the
run's store; ``STAGEWISE_SHM_COLLECTIVES=0`` keeps such groups on gloo.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from stagewise.model.collectives import StageGroups
from stagewise.parallel import comm, shm_group
from stagewise.parallel.runplan import RunPlan

GROUP_ORDER = ("tp", "dcp", "pcp")
SHM_ENV = "STAGEWISE_SHM_COLLECTIVES"


def needs_world(plan: RunPlan, hop_transports: list[str]) -> bool:
    """Whether the run's processes join a torch.distributed world."""
    return plan.world_size > plan.num_stages or "torch" in hop_transports


def join_stage_groups(plan: RunPlan, stage: int, rank: int, store: tuple[str, int] | None, *,
                      timeout_s: float = comm.DEFAULT_TIMEOUT_S) -> StageGroups:
    """Join the run's world through ``store`` as stage ``stage``'s rank ``rank`` and return that
    rank's groups (None store: the run has no world, and every group is one rank)."""
    if store is None:
        if plan.world_size > plan.num_stages:
            raise ValueError(f"stage {stage} rank {rank}: a stage of several ranks needs the driver's store")
        return StageGroups()
    all_ranks = plan.stage_ranks()
    devices = [s.rank_device(r) for s, ranks in zip(plan.stages, all_ranks) for r in range(ranks.size)]
    backend = comm.backend_for(devices)
    me = all_ranks[stage].first + rank
    comm.init_world(rank=me, world_size=plan.world_size, store=store, backend=backend, timeout_s=timeout_s)
    # A group's ranks are one stage's, on one host: they decide the same (the others ignore it).
    shm = shm_group.available() and os.environ.get(SHM_ENV, "1") != "0"
    meet = None
    mine = {}
    for ranks in all_ranks:
        for kind in GROUP_ORDER:
            for members in ranks.groups(kind):
                local = (shm and me in members and len(members) > 1
                         and all(torch.device(devices[m]).type == "cpu" for m in members))
                if local and meet is None:
                    client = dist.TCPStore(store[0], int(store[1]), is_master=False,
                                           timeout=timedelta(seconds=timeout_s))
                    meet = dist.PrefixStore("stagewise-shm", client)
                group = comm.Group.new(list(members), shm_store=meet if local else None,
                                       key=f"{kind}/{'-'.join(map(str, members))}", timeout_s=timeout_s)
                if me in members:
                    mine[kind] = group
    return StageGroups(**mine)

"""The process groups of a run: one torch.distributed world over every rank of every stage, and in
it each stage's tp, dcp and pcp groups (numbered by :class:`~stagewise.parallel.ranks.StageRanks`).

Every process of the run creates every group, in the same order (torch.distributed's rule for
``new_group``), and keeps its own. The world exists only when something needs it: a stage of
several ranks, or the ``torch`` transport between stages (whose peers are the stages' leaders).
"""

from __future__ import annotations

from stagewise.model.collectives import StageGroups
from stagewise.parallel import comm
from stagewise.parallel.runplan import RunPlan

GROUP_ORDER = ("tp", "dcp", "pcp")


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
    backend = comm.backend_for([s.rank_device(r) for s, ranks in zip(plan.stages, all_ranks)
                                for r in range(ranks.size)])
    me = all_ranks[stage].first + rank
    comm.init_world(rank=me, world_size=plan.world_size, store=store, backend=backend, timeout_s=timeout_s)
    mine = {}
    for ranks in all_ranks:
        for kind in GROUP_ORDER:
            for members in ranks.groups(kind):
                group = comm.Group.new(list(members))
                if me in members:
                    mine[kind] = group
    return StageGroups(**mine)

"""Rank groups: the ranks of one stage (:class:`StageRanks`, what the runtime builds) and of a
whole (DP, PP, PCP, TP) layout (:class:`ParallelConfig`, what the planner searches and
``stagewise plan ranks`` prints). Both number a stage's ranks the same way.

Global ranks are laid out as ``[DP, PP, PCP, TP]`` (TP fastest), so
``rank = ((dp * PP + pp) * PCP + pcp) * TP + tp``:

- ``tp``: the tensor-parallel ranks of one stage at one PCP index (contiguous);
- ``dcp``: consecutive runs of ``DCP`` ranks inside a TP group: ranks that hold the same KV head
  and shard its sequence instead of storing it ``DCP`` times (DCP reuses the TP ranks);
- ``pcp``: the prefill-context-parallel ranks of one stage at one TP index, stride ``TP``;
- ``pp``: the stages at one (DP, PCP, TP) coordinate, stride ``PCP * TP``;
- ``dp``: the replicas at one (PP, PCP, TP) coordinate, stride ``PP * PCP * TP``.

A stage's ranks are contiguous: ``pcp * tp`` of them from its first rank, its leader (rank 0 of
the stage), which alone talks to the other stages. Stages of one run may differ in TP and PCP
sizes; their ranks then follow each other in stage order.

The MoE groups span all ranks rather than one stage (``EP * MOE_TP * MOE_DP == world_size``, as
if the pipeline size were 1): layout ``[MOE_DP, EP, MOE_TP]`` over all ranks.

Example: world 8, TP 2, PP 4 -> rank 4 is in PP group [0, 2, 4, 6] at index 2 (the third stage
of TP lane 0).
"""

from __future__ import annotations

from dataclasses import dataclass


def _positive(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name}: expected an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class StageRanks:
    """The ranks of one stage: ``pcp * tp`` global ranks from ``first``; stage rank
    ``r = pcp_rank * tp + tp_rank``."""

    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    first: int = 0
    """Global rank of the stage's leader."""

    def __post_init__(self) -> None:
        for name in ("tp", "pcp", "dcp"):
            _positive("StageRanks", name, getattr(self, name))
        if isinstance(self.first, bool) or not isinstance(self.first, int) or self.first < 0:
            raise ValueError(f"StageRanks.first: expected an int >= 0, got {self.first!r}")
        if self.tp % self.dcp:
            raise ValueError(f"StageRanks: dcp={self.dcp} must divide tp={self.tp} (DCP shards KV inside the TP "
                             f"group)")

    @property
    def size(self) -> int:
        return self.pcp * self.tp

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.first, self.first + self.size))

    def coordinates(self, r: int) -> dict[str, int]:
        """``{pcp, tp, dcp}`` indices of stage rank ``r``."""
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.size:
            raise ValueError(f"StageRanks: stage rank must be an int in [0, {self.size}), got {r!r}")
        tp = r % self.tp
        return {"pcp": r // self.tp, "tp": tp, "dcp": tp % self.dcp}

    def cp_rank(self, r: int) -> int:
        """Index of stage rank ``r`` among the ``pcp * dcp`` ranks sharing its KV head's sequence."""
        c = self.coordinates(r)
        return c["pcp"] * self.dcp + c["dcp"]

    def group(self, kind: str, r: int) -> tuple[int, ...]:
        """Global ranks of stage rank ``r``'s group of ``kind`` (tp, dcp or pcp), in group order."""
        c = self.coordinates(r)
        if kind == "tp":
            members = [c["pcp"] * self.tp + t for t in range(self.tp)]
        elif kind == "dcp":
            start = c["pcp"] * self.tp + c["tp"] - c["dcp"]
            members = list(range(start, start + self.dcp))
        elif kind == "pcp":
            members = [p * self.tp + c["tp"] for p in range(self.pcp)]
        else:
            raise ValueError(f"StageRanks.group: kind must be tp, dcp or pcp; got {kind!r}")
        return tuple(self.first + m for m in members)

    def groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every group of ``kind`` in the stage, in order of their first rank (the order in which
        every rank of a run creates them)."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.size):
            seen.setdefault(self.group(kind, r), None)
        return list(seen)


def stage_ranks(sizes: list[tuple[int, int, int]]) -> list[StageRanks]:
    """The ranks of each stage of a run from its ``(tp, pcp, dcp)``, stages in order."""
    out, first = [], 0
    for tp, pcp, dcp in sizes:
        out.append(StageRanks(tp=tp, pcp=pcp, dcp=dcp, first=first))
        first += out[-1].size
    return out


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """The group of one kind that ``rank`` belongs to."""

    kind: str
    rank: int
    world_size: int
    """Size of the group."""
    rank_group: tuple[int, ...]
    rank_in_group: int


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """A layout: ``world_size == tp * pcp * pp * dp`` and, for MoE groups, ``ep * moe_tp * moe_dp``.
    ``dcp`` divides ``tp`` and needs no ranks of its own."""

    world_size: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    moe_tp: int | None = None
    """Default: ``world_size // (ep * moe_dp)``."""
    moe_dp: int = 1
    pcp: int = 1
    dcp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "dp", "ep", "moe_dp", "pcp", "dcp"):
            _positive("ParallelConfig", name, getattr(self, name))
        if self.tp * self.pcp * self.pp * self.dp != self.world_size:
            raise ValueError(f"ParallelConfig: world_size={self.world_size} must equal tp * pcp * pp * dp = "
                             f"{self.tp} * {self.pcp} * {self.pp} * {self.dp} = "
                             f"{self.tp * self.pcp * self.pp * self.dp}")
        if self.tp % self.dcp:
            raise ValueError(f"ParallelConfig: dcp={self.dcp} must divide tp={self.tp}")
        if self.world_size % (self.ep * self.moe_dp):
            raise ValueError(f"ParallelConfig: ep * moe_dp = {self.ep} * {self.moe_dp} must divide "
                             f"world_size={self.world_size}")
        derived = self.world_size // (self.ep * self.moe_dp)
        if self.moe_tp is None:
            object.__setattr__(self, "moe_tp", derived)
        elif self.moe_tp != derived:
            raise ValueError(f"ParallelConfig: moe_tp={self.moe_tp} but world_size / (ep * moe_dp) = {derived}")

    @classmethod
    def from_sizes(cls, world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, moe_dp: int = 1, *,
                   pcp: int = 1, dcp: int = 1) -> ParallelConfig:
        """DP derived as ``world_size // (tp * pcp * pp)``: the number of pipeline replicas."""
        per_replica = tp * pcp * pp
        if all(isinstance(x, int) and x > 0 for x in (tp, pcp, pp)) and world_size % per_replica:
            raise ValueError(f"ParallelConfig: tp * pcp * pp = {per_replica} must divide world_size={world_size}")
        return cls(world_size=world_size, tp=tp, pp=pp, dp=world_size // per_replica, ep=ep, moe_dp=moe_dp,
                   pcp=pcp, dcp=dcp)

    @property
    def stage_size(self) -> int:
        return self.pcp * self.tp

    def stage(self, rank: int) -> StageRanks:
        """The ranks of ``rank``'s stage (the same numbering the runtime builds)."""
        self._check_rank(rank)
        return StageRanks(tp=self.tp, pcp=self.pcp, dcp=self.dcp, first=rank - rank % self.stage_size)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{dp, pp, pcp, tp}`` indices of ``rank`` in the dense layout."""
        self._check_rank(rank)
        replica, stage = divmod(rank // self.stage_size, self.pp)
        c = self.stage(rank).coordinates(rank % self.stage_size)
        return {"dp": replica, "pp": stage, "pcp": c["pcp"], "tp": c["tp"]}

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"ParallelConfig: rank must be an int in [0, {self.world_size}), got {rank!r}")

    def group(self, kind: str, rank: int) -> ParallelGroup:
        """``rank``'s group of ``kind``: tp, dcp, pcp, pp, dp, ep, moe_tp or moe_dp."""
        self._check_rank(rank)
        if kind in ("tp", "dcp", "pcp"):
            stage = self.stage(rank)
            members = stage.group(kind, rank - stage.first)
            return ParallelGroup(kind, rank, len(members), members, members.index(rank))
        if kind in ("pp", "dp"):
            sizes = {"dp": self.dp, "pp": self.pp}
            strides = {"pp": self.stage_size, "dp": self.stage_size * self.pp}
            c = self.coordinates(rank)
        elif kind in ("ep", "moe_tp", "moe_dp"):
            moe_tp = self.moe_tp
            sizes = {"moe_dp": self.moe_dp, "ep": self.ep, "moe_tp": moe_tp}
            strides = {"moe_tp": 1, "ep": moe_tp, "moe_dp": moe_tp * self.ep}
            c = {"moe_dp": rank // (moe_tp * self.ep), "ep": rank // moe_tp % self.ep, "moe_tp": rank % moe_tp}
        else:
            raise ValueError(f"ParallelConfig.group: kind must be one of {', '.join(GROUP_KINDS)}; got {kind!r}")
        base = rank - c[kind] * strides[kind]
        members = tuple(base + i * strides[kind] for i in range(sizes[kind]))
        return ParallelGroup(kind, rank, sizes[kind], members, c[kind])

    def groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every distinct group of ``kind``, in order of their first rank."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(self.group(kind, rank).rank_group, None)
        return list(seen)

    def label(self) -> str:
        """The parallel label: ``TP=2 | PP=2 | DP=2`` (PCP, DCP, EP, MoE-TP, MoE-DP appended when used)."""
        text = f"TP={self.tp} | PP={self.pp} | DP={self.dp}"
        if self.pcp > 1:
            text += f" | PCP={self.pcp}"
        if self.dcp > 1:
            text += f" | DCP={self.dcp}"
        if self.ep > 1 or self.moe_dp > 1:
            text += f" | EP={self.ep} | MOE_TP={self.moe_tp} | MOE_DP={self.moe_dp}"
        return text


GROUP_KINDS = ("tp", "dcp", "pcp", "pp", "dp", "ep", "moe_tp", "moe_dp")

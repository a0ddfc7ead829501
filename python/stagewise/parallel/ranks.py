"""Rank groups of a (DP, PP, EP, TP) layout.

Global ranks are laid out as ``[-1, DP, PP, EP, TP]`` (TP fastest). The dense groups use
``EP = 1`` inside that layout, so ``rank = (dp * PP + pp) * TP + tp``:

- ``tp``: ranks of one stage of one replica (contiguous, inside the PP dimension);
- ``pp``: the stages at one (DP, TP) coordinate, stride ``TP``;
- ``dp``: the replicas at one (PP, TP) coordinate, stride ``PP * TP``.

The MoE groups span all ranks rather than one stage (``EP * MOE_TP * MOE_DP == world_size``, as
if the pipeline size were 1): layout ``[MOE_DP, EP, MOE_TP]`` over all ranks.

Example: world 8, TP 2, PP 4 -> rank 4 is in PP group [0, 2, 4, 6] at index 2 (the third stage
of TP lane 0).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """A layout: ``world_size == tp * pp * dp`` and, for MoE groups, ``ep * moe_tp * moe_dp``."""

    world_size: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    moe_tp: int | None = None
    """Default: ``world_size // (ep * moe_dp)``."""
    moe_dp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "dp", "ep", "moe_dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name}: expected an int >= 1, got {value!r}")
        if self.tp * self.pp * self.dp != self.world_size:
            raise ValueError(f"ParallelConfig: world_size={self.world_size} must equal tp * pp * dp = "
                             f"{self.tp} * {self.pp} * {self.dp} = {self.tp * self.pp * self.dp}")
        if self.world_size % (self.ep * self.moe_dp):
            raise ValueError(f"ParallelConfig: ep * moe_dp = {self.ep} * {self.moe_dp} must divide "
                             f"world_size={self.world_size}")
        derived = self.world_size // (self.ep * self.moe_dp)
        if self.moe_tp is None:
            object.__setattr__(self, "moe_tp", derived)
        elif self.moe_tp != derived:
            raise ValueError(f"ParallelConfig: moe_tp={self.moe_tp} but world_size / (ep * moe_dp) = {derived}")

    @classmethod
    def from_sizes(cls, world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, moe_dp: int = 1) -> ParallelConfig:
        """DP derived as ``world_size // (tp * pp)``: the number of pipeline replicas."""
        if isinstance(tp, int) and isinstance(pp, int) and tp > 0 and pp > 0 and world_size % (tp * pp):
            raise ValueError(f"ParallelConfig: tp * pp = {tp * pp} must divide world_size={world_size}")
        return cls(world_size=world_size, tp=tp, pp=pp, dp=world_size // (tp * pp), ep=ep, moe_dp=moe_dp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{dp, pp, tp}`` indices of ``rank`` in the dense layout."""
        self._check_rank(rank)
        return {"dp": rank // (self.pp * self.tp), "pp": rank // self.tp % self.pp, "tp": rank % self.tp}

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"ParallelConfig: rank must be an int in [0, {self.world_size}), got {rank!r}")

    def group(self, kind: str, rank: int) -> ParallelGroup:
        """``rank``'s group of ``kind``: tp, pp, dp, ep, moe_tp or moe_dp."""
        self._check_rank(rank)
        if kind in ("tp", "pp", "dp"):
            sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
            strides = {"tp": 1, "pp": self.tp, "dp": self.tp * self.pp}
            c = self.coordinates(rank)
        elif kind in ("ep", "moe_tp", "moe_dp"):
            moe_tp = self.moe_tp
            sizes = {"moe_dp": self.moe_dp, "ep": self.ep, "moe_tp": moe_tp}
            strides = {"moe_tp": 1, "ep": moe_tp, "moe_dp": moe_tp * self.ep}
            c = {"moe_dp": rank // (moe_tp * self.ep), "ep": rank // moe_tp % self.ep, "moe_tp": rank % moe_tp}
        else:
            raise ValueError(f"ParallelConfig.group: kind must be one of tp, pp, dp, ep, moe_tp, moe_dp; got {kind!r}")
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
        """The parallel label: ``TP=2 | PP=2 | DP=2`` (EP, MoE-TP, MoE-DP appended when used)."""
        text = f"TP={self.tp} | PP={self.pp} | DP={self.dp}"
        if self.ep > 1 or self.moe_dp > 1:
            text += f" | EP={self.ep} | MOE_TP={self.moe_tp} | MOE_DP={self.moe_dp}"
        return text

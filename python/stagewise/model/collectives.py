"""The collectives a stage's model calls, as a protocol: the model never imports a process-group
library. :class:`stagewise.parallel.comm.Group` implements it over torch.distributed (gloo, NCCL);
:data:`SINGLE` is the group of one rank, under which every collective returns its input and the
model runs exactly as it does without parallelism.

A stage's ranks form three groups (:class:`StageGroups`, numbered by
:class:`stagewise.parallel.ranks.StageRanks`):

- ``tp``: the tensor-parallel ranks (column/row-parallel linears, vocab-parallel embedding and LM
  head, each rank its query heads);
- ``dcp``: the ranks inside ``tp`` that hold the same KV head and shard its sequence instead of
  each storing all of it (decode context parallel);
- ``pcp``: the prefill-context-parallel ranks: same TP index, different parts of the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Collectives(Protocol):
    """One group of ranks. Every rank of the group calls each collective, in the same order, with
    tensors of the same shape and dtype."""

    @property
    def size(self) -> int: ...

    @property
    def rank(self) -> int:
        """This process's index in the group."""
        ...

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns ``t``."""
        ...

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order."""
        ...

    def gather(self, t: torch.Tensor, dim: int = 0, dst: int = 0) -> torch.Tensor | None:
        """As :meth:`all_gather`, on group rank ``dst`` only; None elsewhere."""
        ...

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The sum over the group split into ``size`` chunks along ``dim``; rank ``i`` gets chunk ``i``."""
        ...


class _Single:
    """The group of one rank: every collective is the identity."""

    size = 1
    rank = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t

    def gather(self, t: torch.Tensor, dim: int = 0, dst: int = 0) -> torch.Tensor | None:
        return t

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t

    def __repr__(self) -> str:
        return "SINGLE"


SINGLE: Collectives = _Single()


@dataclass(frozen=True, slots=True)
class StageGroups:
    """The groups of one rank of a stage (each :data:`SINGLE` when the stage is one process)."""

    tp: Collectives = SINGLE
    dcp: Collectives = SINGLE
    pcp: Collectives = SINGLE

    def __post_init__(self) -> None:
        for name in ("tp", "dcp", "pcp"):
            if not isinstance(getattr(self, name), Collectives):
                raise TypeError(f"StageGroups.{name}: expected a Collectives group, got "
                                f"{type(getattr(self, name)).__name__}")
        if self.tp.size % self.dcp.size:
            raise ValueError(f"StageGroups: the dcp group ({self.dcp.size} ranks) must divide the tp group "
                             f"({self.tp.size} ranks)")

    @property
    def size(self) -> int:
        """Ranks (processes) of the stage: ``pcp * tp``."""
        return self.pcp.size * self.tp.size

    @property
    def cp_size(self) -> int:
        """Ranks that share one KV head's sequence: ``pcp * dcp``."""
        return self.pcp.size * self.dcp.size

    @property
    def cp_rank(self) -> int:
        """This rank's index among them (PCP-major), the ``cp_rank`` of the KV slot mapping."""
        return self.pcp.rank * self.dcp.size + self.dcp.rank

"""A rank's place in a group, for tests that load a shard or check a layout without running any
collective: :class:`NoCollectives`."""

from __future__ import annotations


class NoCollectives:
    """Rank ``rank`` of a group of ``size`` whose collectives must not be reached."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def _never(self, *args, **kwargs):
        raise AssertionError("a collective was reached where none should run")

    all_reduce = all_gather = gather = reduce_scatter = _never

"""Free-list allocator of KV block ids ``0 .. num_blocks - 1`` for one stage."""

from __future__ import annotations


class OutOfKVBlocks(RuntimeError):
    """Too few free blocks for a request. Recoverable: nothing was allocated and no
    other request changed, so the caller may wait, preempt or reject and retry."""

    def __init__(self, message: str, *, needed: int, free: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free


class BlockGeometry:
    """What a block-table entry covers, for a class with ``block_size``, ``max_blocks_per_seq`` and
    ``cp_world_size`` attributes."""

    block_size: int
    max_blocks_per_seq: int
    cp_world_size: int

    @property
    def tokens_per_block(self) -> int:
        """Positions one block-table entry covers: ``block_size * cp_world_size``."""
        return self.block_size * self.cp_world_size

    @property
    def max_model_len(self) -> int:
        return self.max_blocks_per_seq * self.tokens_per_block


class BlockPool:
    """Hands out block ids; each id is either free or held by exactly one owner."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"BlockPool: num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # A stack: allocation pops from the end, free pushes on it. Fresh pools hand
        # out 0, 1, 2, ... and a freed run of ids comes back in the same order,
        # which keeps block tables readable when debugging.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` distinct free ids, or :class:`OutOfKVBlocks` with nothing taken."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"BlockPool.allocate: n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfKVBlocks(
                f"BlockPool.allocate: {n} blocks needed, {len(self._free)} of {self.num_blocks} free",
                needed=n,
                free=len(self._free),
            )
        ids = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for i in ids:
            self._is_free[i] = False
        return ids

    def free(self, ids: list[int]) -> None:
        """Return ``ids`` to the pool. All are checked first: a foreign, free or
        repeated id raises ValueError and frees none of them."""
        ids = list(ids)
        seen: set[int] = set()
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_blocks:
                raise ValueError(f"BlockPool.free: block id {i!r} is not in [0, {self.num_blocks})")
            if self._is_free[i] or i in seen:
                raise ValueError(f"BlockPool.free: block id {i} is already free (double free)")
            seen.add(i)
        for i in ids:
            self._is_free[i] = True
        self._free.extend(reversed(ids))

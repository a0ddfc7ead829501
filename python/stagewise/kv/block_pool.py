"""The KV block ids ``0 .. num_blocks - 1`` of one stage: who holds each, and the cached ones."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


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
    """Hands out block ids, counts who holds each, and keeps the content of blocks nobody holds
    any more for as long as the pool can: prefix caching's store.

    A block is *free* (on the free stack: its content is of no use), *held* (by one request or,
    when requests share a cached prefix, several: a reference count) or *cached* (held by
    nobody, but its KV is whole and may be shared again; kept in least-recently-released order).
    :meth:`allocate` takes free blocks first and evicts cached ones, the oldest first, only when
    the free ones run out, so a cached block costs no capacity.

    Every stage of a pipeline, and every rank of a stage, keeps a pool of the same size and makes
    the same calls in the same order, so their block ids agree: stage 0 can name a cached block
    and each stage finds its own layers' KV of the same tokens in it."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"BlockPool: num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.on_evict: Callable[[int], None] | None = None
        """Told of each cached block that :meth:`allocate` takes back (stage 0's prefix index)."""
        self.reset()

    def reset(self) -> None:
        """The state of a new pool: every block free, in the order a new pool hands them out."""
        # A stack: allocation pops from the end, free pushes on it. Fresh pools hand
        # out 0, 1, 2, ... and a freed run of ids comes back in the same order,
        # which keeps block tables readable when debugging.
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._refs = [0] * self.num_blocks
        self._cached: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out: the free ones and the cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks nobody holds whose KV is kept for a later request to share."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks some request holds (each counted once, however many share it)."""
        return self.num_blocks - self.num_free

    def refs(self, block: int) -> int:
        """How many requests hold ``block``."""
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def allocate(self, n: int) -> list[int]:
        """``n`` distinct blocks, each now held once: free ones first, then cached ones, the least
        recently released first; :class:`OutOfKVBlocks` with nothing taken."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"BlockPool.allocate: n must be an int >= 0, got {n!r}")
        if n > self.num_free:
            raise OutOfKVBlocks(
                f"BlockPool.allocate: {n} blocks needed, {self.num_free} of {self.num_blocks} free",
                needed=n,
                free=self.num_free,
            )
        take = min(n, len(self._free))
        ids = self._free[len(self._free) - take :][::-1]
        del self._free[len(self._free) - take :]
        for _ in range(n - take):
            block, _ = self._cached.popitem(last=False)
            ids.append(block)
            if self.on_evict is not None:
                self.on_evict(block)
        for i in ids:
            self._refs[i] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        """Hold blocks that are held or cached once more (a request reusing a cached prefix).
        ValueError, with nothing changed, for a foreign id or a free block (its KV is gone)."""
        for i in ids:
            self._check_id("share", i)
            if not self._refs[i] and i not in self._cached:
                raise ValueError(f"BlockPool.share: block id {i} is free: it holds no cached KV to share")
        for i in ids:
            if not self._refs[i]:
                del self._cached[i]
            self._refs[i] += 1

    def free(self, ids: list[int], *, cache: bool = False) -> None:
        """Release one hold on each of ``ids``. A block nobody holds any more becomes cached (kept,
        the last of ``ids`` to be evicted first) when ``cache``, else free. All are checked first:
        a foreign, free or repeated id raises ValueError and releases none of them."""
        ids = list(ids)
        seen: set[int] = set()
        for i in ids:
            self._check_id("free", i)
            if not self._refs[i] or i in seen:
                raise ValueError(f"BlockPool.free: block id {i} is already free (double free)")
            seen.add(i)
        released = []
        for i in ids:
            self._refs[i] -= 1
            if not self._refs[i]:
                released.append(i)
        if cache:
            for i in reversed(released):
                self._cached[i] = None
        else:
            self._free.extend(reversed(released))

    def _check_id(self, op: str, i: object) -> None:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_blocks:
            raise ValueError(f"BlockPool.{op}: block id {i!r} is not in [0, {self.num_blocks})")

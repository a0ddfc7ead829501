"""Stage 0's count of the KV blocks every stage's ranks will hold, by layer group.

The scheduler admits a request only when every layer group of the model (full attention, and each
sliding window; :mod:`stagewise.kv.window`) has room for what the request may hold there: a
full-attention group the blocks of its whole prompt at once, then one more whenever its tokens
cross a block boundary; a window group its phase's cap. Every stage's pool of a group has the
size the budget counts with, and no stage ever holds more of a request than its reservation, so
what the scheduler admitted cannot fail to allocate on any stage.

It counts, it hands out no block ids: each stage's :class:`~stagewise.kv.KVCacheManager` takes its
own (all stages take them in the same order, so they agree).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from stagewise.kv.block_pool import BlockGeometry, OutOfKVBlocks
from stagewise.kv.window import reservation


@dataclass(kw_only=True, frozen=True, slots=True)
class GroupPool:
    """One layer group's pool as the budget sees it."""

    window: int | None
    """The group's window; None: full attention."""
    num_blocks: int


class KVBudget(BlockGeometry):
    """Per request and per group, the blocks a request may hold; admission needs room in every group."""

    def __init__(self, pools: Sequence[GroupPool], *, block_size: int, max_blocks_per_seq: int,
                 cp_world_size: int = 1) -> None:
        if not pools:
            raise ValueError("KVBudget: no layer group")
        for name, value in (("block_size", block_size), ("max_blocks_per_seq", max_blocks_per_seq),
                            ("cp_world_size", cp_world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVBudget: {name} must be an int >= 1, got {value!r}")
        self.pools = tuple(pools)
        self.block_size, self.max_blocks_per_seq, self.cp_world_size = block_size, max_blocks_per_seq, cp_world_size
        self._used = [0] * len(self.pools)
        self._held: dict[Hashable, tuple[int, list[int]]] = {}  # request -> (tokens, blocks per group)

    @property
    def num_blocks(self) -> int:
        """Blocks of the first group's pool (the full-attention one when the model has one)."""
        return self.pools[0].num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pools[0].num_blocks - self._used[0]

    def need(self, num_tokens: int, *, decoding: bool) -> list[int]:
        """What a request of ``num_tokens`` tokens may hold in each group."""
        return [reservation(p.window, self.block_size, num_tokens, decoding=decoding,
                            tokens_per_block=self.tokens_per_block) for p in self.pools]

    def fits_at_all(self, num_tokens: int) -> str | None:
        """Why a prompt of ``num_tokens`` tokens can never be admitted (None: it can, once there is room)."""
        for pool, n in zip(self.pools, self.need(num_tokens, decoding=False)):
            if n > pool.num_blocks:
                what = "the whole KV cache" if pool.window is None else f"the pool of the {pool.window}-token window"
                return f"needs {n} KV blocks, more than the {pool.num_blocks} blocks of {what}"
        return None

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._held

    def num_tokens(self, request_id: Hashable) -> int:
        """The tokens the request's reservation is for."""
        return self._held[request_id][0]

    def reserved(self, request_id: Hashable) -> list[int]:
        """The blocks the request may hold in each group."""
        return list(self._held[request_id][1])

    def add(self, request_id: Hashable, num_prompt_tokens: int) -> None:
        """Reserve a prompt's blocks; :class:`OutOfKVBlocks` (nothing reserved) when a group is short."""
        if request_id in self._held:
            raise ValueError(f"KVBudget.add: request {request_id!r} is already registered")
        self._reserve(request_id, num_prompt_tokens, [0] * len(self.pools), decoding=False)

    def append(self, request_id: Hashable, n: int = 1) -> None:
        """Grow a decoding request by ``n`` tokens; :class:`OutOfKVBlocks` (nothing changed) when short."""
        tokens, held = self._held[request_id]
        self._reserve(request_id, tokens + n, held, decoding=True)

    def truncate(self, request_id: Hashable, n: int) -> None:
        """Shrink a decoding request to ``n`` tokens (a speculative step's rejected drafts), as every
        stage's :meth:`~stagewise.kv.KVCacheManager.truncate` does."""
        tokens, held = self._held[request_id]
        if not 0 <= n <= tokens:
            raise ValueError(f"KVBudget.truncate: request {request_id!r} holds {tokens} tokens, cannot keep {n}")
        want = self.need(n, decoding=True)
        for g, m in enumerate(want):
            want[g] = min(m, held[g])
            self._used[g] -= held[g] - want[g]
        self._held[request_id] = (n, want)

    def free(self, request_id: Hashable) -> None:
        _, held = self._held.pop(request_id)
        for g, n in enumerate(held):
            self._used[g] -= n

    def _reserve(self, request_id: Hashable, tokens: int, held: list[int], *, decoding: bool) -> None:
        if -(-tokens // self.tokens_per_block) > self.max_blocks_per_seq:
            raise ValueError(f"KVBudget: request {request_id!r} would hold {tokens} tokens, over max_model_len="
                             f"{self.max_model_len}")
        want = self.need(tokens, decoding=decoding)
        for g, pool in enumerate(self.pools):
            extra = want[g] - held[g]
            if self._used[g] + extra > pool.num_blocks:
                where = "" if pool.window is None else f" of the {pool.window}-token window"
                free = pool.num_blocks - self._used[g]
                raise OutOfKVBlocks(f"{extra} more blocks{where} needed, {free} of {pool.num_blocks} free",
                                    needed=extra, free=free)
        for g, n in enumerate(want):
            self._used[g] += n - held[g]
        self._held[request_id] = (tokens, want)

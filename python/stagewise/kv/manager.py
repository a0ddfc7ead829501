"""Per-request KV bookkeeping of one stage: block ids, token counts, block tables
and slot mappings.

Lifecycle: a stage calls :meth:`KVCacheManager.add` when it first
sees a request (blocks for the prompt), :meth:`~KVCacheManager.append` for every
new token, and :meth:`~KVCacheManager.free` on finish, cancel or abort. It never
asks another stage for KV.

Context parallelism (the layout is spelled out in ``include/stagewise/cache.h``): with
``cp_world_size = cp`` a block-table entry is a *virtual* block of
``block_size * cp`` positions, of which this rank stores only its share in one
local block of ``block_size`` slots. Every rank keeps the same token counts and
its own block ids; only :func:`stagewise.ops.slot_mapping` knows which positions
a rank stores.

Sliding window (``window=W``, the manager of a stage's layers with that window): a request keeps
only the blocks its next queries can reach. A step stores only the positions a later query sees,
:meth:`~KVCacheManager.trim` gives back the blocks wholly before the window after each step, and
the block table holds :data:`PAD_BLOCK_ID` where a block was given back (or never taken); the
attention ops never read those entries. The rule and its bounds are :mod:`stagewise.kv.window`'s.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import torch

from stagewise import ops
from stagewise.int_tensors import int_tensor
from stagewise.kv.block_pool import BlockGeometry, BlockPool

# Block-table entries past a request's blocks. decode_attention reads only the
# entries a sequence's length covers, and slot_mapping raises (CPU) or writes
# nothing (CUDA) for a negative id, so a position past a request's blocks can
# never land in block 0 of another request.
PAD_BLOCK_ID = -1


class KVCacheManager(BlockGeometry):
    """Block ids and token counts of every live request on one stage (one CP rank)."""

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        max_blocks_per_seq: int,
        cp_world_size: int = 1,
        cp_rank: int = 0,
        interleave_size: int = 1,
        window: int | None = None,
    ) -> None:
        for name, value, low in (
            ("block_size", block_size, 1),
            ("num_blocks", num_blocks, 0),
            ("max_blocks_per_seq", max_blocks_per_seq, 1),
            ("cp_world_size", cp_world_size, 1),
            ("interleave_size", interleave_size, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"KVCacheManager: {name} must be an int >= {low}, got {value!r}")
        if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_world_size:
            raise ValueError(f"KVCacheManager: cp_rank must be in [0, cp_world_size={cp_world_size}), got {cp_rank!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"KVCacheManager: window must be an int >= 1 or None, got {window!r}")
        if window is not None and cp_world_size > 1:
            raise ValueError(f"KVCacheManager: a sliding window ({window}) cannot be sharded over "
                             f"cp_world_size={cp_world_size} context-parallel ranks")
        if block_size % interleave_size:
            raise ValueError(
                f"KVCacheManager: interleave_size must divide block_size={block_size}, got {interleave_size}"
            )
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.cp_world_size = cp_world_size
        self.cp_rank = cp_rank
        self.interleave_size = interleave_size
        self.window = window
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[Hashable, list[int]] = {}
        self._num_tokens: dict[Hashable, int] = {}

    # ---- sizes ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks this rank holds for live requests: ``sum ceil(n / tokens_per_block)``, so under
        context parallelism ``cp`` times fewer than one rank holding every token."""
        return self.pool.num_used

    def num_stored_tokens(self) -> int:
        """Token slots this rank fills, over all live requests (its share of their positions)."""
        return sum(self.num_local_tokens(r) for r in self._num_tokens)

    def blocks_for(self, num_tokens: int) -> int:
        """Block-table entries that ``num_tokens`` positions need: ``ceil(n / tokens_per_block)``."""
        return -(-num_tokens // self.tokens_per_block)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether :meth:`add` of a ``num_tokens`` prompt would succeed now."""
        width = self.blocks_for(num_tokens)
        need = width - self.stored_from(0, num_tokens) // self.tokens_per_block
        return 0 <= num_tokens and width <= self.max_blocks_per_seq and need <= self.pool.num_free

    # ---- lifecycle -----------------------------------------------------------

    def add(self, request_id: Hashable, num_prompt_tokens: int, prefix: Sequence[int] = ()) -> None:
        """Register a new request with blocks for its first ``num_prompt_tokens`` positions.
        ``prefix``: cached blocks it starts with (a prefix-cache hit: its first ``len(prefix)``
        blocks, already held for it through :meth:`share`); the rest are taken from the pool.
        Raises ValueError for a known id, a prompt over ``max_model_len`` or a prefix longer than
        the prompt, :class:`OutOfKVBlocks` when the pool is short; on error nothing changes (the
        prefix's holds stay the caller's)."""
        if request_id in self._num_tokens:
            raise ValueError(f"KVCacheManager.add: request {request_id!r} is already registered")
        if not isinstance(num_prompt_tokens, int) or num_prompt_tokens < 0:
            raise ValueError(
                f"KVCacheManager.add: num_prompt_tokens of request {request_id!r} must be an int >= 0, "
                f"got {num_prompt_tokens!r}"
            )
        if len(prefix) * self.tokens_per_block > num_prompt_tokens or (prefix and self.window is not None):
            raise ValueError(f"KVCacheManager.add: request {request_id!r} cannot start with {len(prefix)} cached "
                             f"blocks ({num_prompt_tokens} tokens, window {self.window})")
        self._check_capacity("add", request_id, num_prompt_tokens)
        self._blocks[request_id] = self._grown(list(prefix), len(prefix) * self.tokens_per_block, num_prompt_tokens)
        self._num_tokens[request_id] = num_prompt_tokens

    def share(self, blocks: Sequence[int]) -> None:
        """Hold cached (or held) blocks for a request that :meth:`add` will start with them."""
        self.pool.share(list(blocks))

    def unshare(self, blocks: Sequence[int]) -> None:
        """Give back the holds of :meth:`share` when the request did not start after all."""
        self.pool.free(list(blocks), cache=True)

    def append(self, request_id: Hashable, n: int = 1) -> None:
        """Grow a request by ``n`` slots, taking a block whenever a boundary is crossed.
        All or nothing, with the errors of :meth:`add`."""
        have = self.num_tokens(request_id)
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"KVCacheManager.append: n for request {request_id!r} must be an int >= 0, got {n!r}")
        self._check_capacity("append", request_id, have + n)
        self.trim(request_id)
        self._blocks[request_id] = self._grown(self._blocks[request_id], have, have + n)
        self._num_tokens[request_id] = have + n

    def truncate(self, request_id: Hashable, n: int) -> None:
        """Shrink a request to its first ``n`` positions: the KV of the later ones (draft tokens a
        speculative step wrote and the last stage rejected) is dropped, and the blocks wholly past
        ``n`` go back to the pool (not cached: they hold rejected tokens). Every stage and rank
        truncates at the same step, so their pools stay the same. Not with a sliding window (its
        trimmed front cannot come back)."""
        have = self.num_tokens(request_id)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= have:
            raise ValueError(f"KVCacheManager.truncate: n for request {request_id!r} must be an int in [0, {have}], "
                             f"got {n!r}")
        if self.window is not None and n < have:
            raise ValueError(f"KVCacheManager.truncate: request {request_id!r} holds a {self.window}-token window, "
                             "which cannot be rolled back")
        blocks, keep = self._blocks[request_id], self.blocks_for(n)
        self.pool.free([b for b in blocks[keep:] if b != PAD_BLOCK_ID])
        del blocks[keep:]
        self._num_tokens[request_id] = n

    def _grown(self, blocks: list[int], have: int, total: int) -> list[int]:
        """``blocks`` with the blocks of the positions ``[have, total)`` stores taken from the pool
        (all at once, or :class:`OutOfKVBlocks` with none taken)."""
        first = self.stored_from(have, total)
        per = self.tokens_per_block
        grown = blocks + [PAD_BLOCK_ID] * (self.blocks_for(total) - len(blocks))
        stored = range(first // per, self.blocks_for(total)) if first < total else range(0)
        missing = [j for j in stored if grown[j] == PAD_BLOCK_ID]
        for j, block in zip(missing, self.pool.allocate(len(missing))):
            grown[j] = block
        return grown

    def stored_from(self, have: int, total: int) -> int:
        """The first position a step that brings ``[have, total)`` stores: ``have``, or with a window
        the first one a later query sees (``total - window + 1``) when that is later."""
        return have if self.window is None else max(have, total - self.window + 1)

    def kept_from(self, request_id: Hashable) -> int:
        """The first position the request still holds between steps (0 without a window)."""
        n = self.num_tokens(request_id)
        return 0 if self.window is None else max(0, n - self.window + 1)

    def trim(self, request_id: Hashable) -> int:
        """Give back the blocks wholly before the window of the request's next query; returns how
        many. Nothing to give back without a window."""
        if self.window is None:
            return 0
        blocks = self._blocks[request_id]
        gone = [j for j in range(self.kept_from(request_id) // self.tokens_per_block) if blocks[j] != PAD_BLOCK_ID]
        self.pool.free([blocks[j] for j in gone])
        for j in gone:
            blocks[j] = PAD_BLOCK_ID
        return len(gone)

    def free(self, request_id: Hashable) -> None:
        """Release every block of a finished, cancelled or aborted request. Its full blocks (every
        position written) stay cached in the pool for a later request with the same prefix; its
        last, partial one is free at once."""
        full = self.num_tokens(request_id) // self.tokens_per_block  # raises for an unknown id
        blocks = self._blocks.pop(request_id)
        del self._num_tokens[request_id]
        self.pool.free([b for b in blocks[:full] if b != PAD_BLOCK_ID], cache=True)
        self.pool.free([b for b in blocks[full:] if b != PAD_BLOCK_ID])

    def reset(self) -> None:
        """Forget every cached block: the pool as new (only when no request is live)."""
        if self._num_tokens:
            raise ValueError(f"KVCacheManager.reset: {len(self._num_tokens)} requests still hold KV blocks")
        self.pool.reset()

    def _check_capacity(self, op: str, request_id: Hashable, total: int) -> None:
        if self.blocks_for(total) > self.max_blocks_per_seq:
            raise ValueError(
                f"KVCacheManager.{op}: request {request_id!r} would hold {total} tokens, over max_model_len="
                f"{self.max_model_len} ({self.max_blocks_per_seq} blocks x {self.tokens_per_block} tokens)"
            )

    # ---- queries -------------------------------------------------------------

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._num_tokens

    def __len__(self) -> int:
        return len(self._num_tokens)

    def request_ids(self) -> list[Hashable]:
        """The live requests, in the order they were added."""
        return list(self._num_tokens)

    def num_tokens(self, request_id: Hashable) -> int:
        """Positions allocated to the request (on every CP rank alike)."""
        try:
            return self._num_tokens[request_id]
        except KeyError:
            raise ValueError(f"KVCacheManager: unknown request {request_id!r}") from None

    def block_ids(self, request_id: Hashable) -> list[int]:
        """The request's block-table entries (:data:`PAD_BLOCK_ID` where a window gave one back)."""
        self.num_tokens(request_id)
        return list(self._blocks[request_id])

    def num_local_tokens(self, request_id: Hashable) -> int:
        """Of the request's positions, how many this CP rank stores. They fill its
        blocks in order (local token j at block j // block_size, offset
        j % block_size), so this is the rank's ``seq_lens`` for decode_attention."""
        return int(self.num_local_positions(self.num_tokens(request_id)))

    def num_local_positions(self, n: int | torch.Tensor) -> int | torch.Tensor:
        """Of the first ``n`` positions of any sequence (an int, or a tensor of them), how many this
        CP rank stores: a query at position ``p`` sees ``num_local_positions(p + 1)`` of its cached
        tokens on this rank, the first ones of its blocks."""
        cp, inter, rank = self.cp_world_size, self.interleave_size, self.cp_rank
        full, rest = n // self.tokens_per_block, n % self.tokens_per_block
        chunks, partial = rest // inter, rest % inter  # whole interleave chunks of the last virtual block
        owned_chunks = (chunks - rank + cp - 1) // cp  # chunks r, r + cp, ... below ``chunks`` (rank < cp)
        return full * self.block_size + owned_chunks * inter + partial * (chunks % cp == rank)

    def block_tables(self, request_ids: Sequence[Hashable], device: torch.device | str = "cpu") -> torch.Tensor:
        """int32 ``[len(request_ids), max_blocks_per_seq]``: row i holds request i's
        block ids, then :data:`PAD_BLOCK_ID`. The width is fixed so the shape does
        not change from step to step."""
        table = torch.full((len(request_ids), self.max_blocks_per_seq), PAD_BLOCK_ID, dtype=torch.int32)
        for row, request_id in enumerate(request_ids):
            ids = self.block_ids(request_id)
            table[row, : len(ids)] = int_tensor(ids, torch.int32)
        return table.to(device)

    def slot_mapping(
        self,
        spans: Iterable[tuple[Hashable, int, int]],
        device: torch.device | str = "cpu",
        block_tables: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Cache slots ``[T]`` int64 of a batch given as spans ``(request_id, first_position,
        num_tokens)`` (a prefill chunk, or one decode token), in span order; -1 where
        another CP rank stores the position. Positions must already be allocated.
        ``block_tables``, when the caller already built it, must be
        ``self.block_tables(distinct request ids in span order)``."""
        rows: dict[Hashable, int] = {}
        seq_index: list[int] = []
        positions: list[int] = []
        stored: list[int] = []  # with a window: the tokens it stores (the others map to -1)
        offset = 0
        for request_id, first, count in spans:
            have = self.num_tokens(request_id)
            if first < 0 or count < 0 or first + count > have:
                raise ValueError(
                    f"KVCacheManager.slot_mapping: positions [{first}, {first + count}) of request "
                    f"{request_id!r} are outside its {have} allocated tokens (append first)"
                )
            row = rows.setdefault(request_id, len(rows))
            start = first
            if self.window is not None:
                start = self.stored_from(first, have)
                stored.extend(range(offset + start - first, offset + count))
            seq_index.extend([row] * (first + count - start))
            positions.extend(range(start, first + count))
            offset += count
        if block_tables is None:
            block_tables = self.block_tables(list(rows), device)
        elif block_tables.size(0) != len(rows):
            raise ValueError(
                f"KVCacheManager.slot_mapping: block_tables has {block_tables.size(0)} rows, "
                f"the spans name {len(rows)} requests"
            )
        slots = ops.slot_mapping(
            block_tables,
            int_tensor(seq_index, torch.int32, device),
            int_tensor(positions, device=device),
            self.block_size,
            self.cp_world_size,
            self.cp_rank,
            self.interleave_size,
        )
        if self.window is None:
            return slots
        out = torch.full((offset,), -1, dtype=torch.int64, device=device)
        out[torch.tensor(stored, dtype=torch.int64, device=device)] = slots
        return out

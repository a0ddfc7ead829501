"""Stage 0's prefix caching: a new request starts after the longest chain of full KV blocks that
earlier requests with the same beginning left in the pool (:mod:`stagewise.kv.prefix` has the
identities and the index; :class:`~stagewise.kv.block_pool.BlockPool` keeps the blocks).

- **Lookup**, when the scheduler admits a request: its prompt's full blocks (all but the block of
  its last token, which is always computed for its logits) are looked up by identity; the hit's
  blocks go with the request's first step (``StepBatch.prefix_blocks``), which starts at the first
  uncached position on every stage.
- **Waiting for a prefill in flight**: the queue's head waits while an admitted request computes
  the block it would find next (:meth:`PrefixCaching.waits`); admitted after that step, it finds
  it, instead of computing it again beside the other.
- **Registration**, when a step's tokens come back (its KV is then written on every stage): each
  request's blocks that the step filled are named by their identities, prompt and generated
  tokens alike, so a chat that resends its conversation finds its previous answer too.
- **Out of step**: a step that failed on some stages (or ranks) but not others leaves their pools
  in different states, so a block id may no longer mean the same KV everywhere. The index is then
  emptied and lookups pause until no request holds KV, when every stage's pools are reset
  together (:meth:`~stagewise.engine.executor.Executor.reset_kv`, ``ResetKV`` down the pipeline).

A model with a sliding window does not cache prefixes (its window groups give blocks back as the
window moves; a hit would need the window's blocks, not the prefix's).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Hashable

from stagewise.engine.images import VisionRequest
from stagewise.engine.scheduler import SeqState
from stagewise.kv import KVCacheManager
from stagewise.kv.prefix import PrefixIndex, PrefixStats, block_hashes


class PrefixCaching:
    """The index over stage 0's pool and each live request's block identities."""

    def __init__(self, manager: KVCacheManager, vision: Callable[[Hashable], VisionRequest | None]) -> None:
        """``manager``: stage 0's manager of the full-attention group (every stage's pools make the same
        calls); ``vision``: a request's images, whose content is part of its blocks' identities."""
        self.manager, self._vision = manager, vision
        self.index = PrefixIndex(manager.pool, manager.tokens_per_block)
        self.paused = False
        """True while the stages' pools may be out of step (no lookups until they are reset)."""
        self._hashes: dict[Hashable, list[bytes]] = {}
        self._named: dict[Hashable, int] = {}
        """Per live request: blocks already registered."""
        self._queued: dict[Hashable, list[bytes]] = {}
        """The prompt identities of a request that :meth:`waits` held back, until it is admitted."""
        self._pending: Counter[bytes] = Counter()
        """The identities of live requests' blocks not yet registered (each request's ``_hashes``
        past its ``_named``), counted: what :meth:`waits` looks for."""

    @property
    def stats(self) -> PrefixStats:
        return self.index.stats

    @property
    def tokens_per_block(self) -> int:
        return self.manager.tokens_per_block

    def lookup(self, seq: SeqState) -> int:
        """The prompt tokens of a request being admitted that are cached; its ``prefix_blocks`` set."""
        self._queued.pop(seq.request_id, None)
        n = len(seq.prompt_ids)
        blocks = [] if self.paused else self.index.lookup(self._identities(seq, seq.prompt_ids), n)
        seq.prefix_blocks = tuple(blocks)
        seq.cached_tokens = len(blocks) * self.tokens_per_block
        return seq.cached_tokens

    def waits(self, seq: SeqState) -> bool:
        """Whether a queued request should wait before it is admitted: the first block it would
        compute (after the cached chain) is one that an admitted request is computing now (its
        identity is among that request's blocks not yet registered). The step that computes it
        registers it, and the request then finds it instead of computing it again."""
        if self.paused or not self._hashes:
            return False
        mine = self._queued.get(seq.request_id)
        if mine is None:
            vision = self._vision(seq.request_id)
            mine = self._queued[seq.request_id] = block_hashes(
                seq.prompt_ids, self.tokens_per_block, [], None if vision is None else image_bytes(vision))
        hit = len(self.index.chain(mine, len(seq.prompt_ids)))
        if hit >= min(len(mine), (len(seq.prompt_ids) - 1) // self.tokens_per_block):
            return False  # nothing more it could find
        return mine[hit] in self._pending

    def written(self, seq: SeqState, end: int) -> None:
        """The KV of the request's positions ``[0, end)`` is written on every stage."""
        full, named = end // self.tokens_per_block, self._named.get(seq.request_id, 0)
        if full <= named or self.paused:
            return
        tokens = seq.prompt_ids if end <= len(seq.prompt_ids) else seq.prompt_ids + seq.output_ids
        hashes = self._identities(seq, tokens[:end])
        self.index.register(self.manager.block_ids(seq.request_id)[named:full], hashes[named:full])
        self._named[seq.request_id] = full
        self._registered(hashes[named:full])

    def forget(self, request_id: Hashable) -> None:
        """The request ended (its blocks stay in the pool, cached, for as long as it keeps them)."""
        hashes, named = self._hashes.pop(request_id, []), self._named.pop(request_id, 0)
        self._registered(hashes[named:])
        self._queued.pop(request_id, None)

    def reset(self) -> int:
        """Forget every entry (an admin's reset); returns how many blocks were named."""
        n = len(self.index)
        self.index.clear()
        self._named.clear()
        self._pending = Counter(h for hashes in self._hashes.values() for h in hashes)
        return n

    def out_of_step(self) -> None:
        """Some stages ran a step the others did not: no block may be named until the pools reset
        (:meth:`resumed`); nothing is registered meanwhile."""
        self.paused = True
        self.reset()

    def resumed(self) -> None:
        """Every stage's pools were reset (:meth:`Executor.reset_kv`): lookups go on."""
        self.paused = False

    def _identities(self, seq: SeqState, tokens: list[int]) -> list[bytes]:
        known = self._hashes.setdefault(seq.request_id, [])
        vision, before = self._vision(seq.request_id), len(known)
        block_hashes(tokens, self.tokens_per_block, known, None if vision is None else image_bytes(vision))
        self._pending.update(known[before:])
        return known

    def _registered(self, identities: list[bytes]) -> None:
        """Take blocks off :attr:`_pending` (registered, or their request ended)."""
        for h in identities:
            if (left := self._pending[h] - 1) > 0:
                self._pending[h] = left
            else:
                self._pending.pop(h, None)


def image_bytes(vision: VisionRequest) -> Callable[[int, int], bytes]:
    """``extra(start, end)`` for :func:`~stagewise.kv.prefix.block_hashes`: the content hashes of the
    images whose tokens lie in ``[start, end)`` (each image's pixels and grid)."""
    if vision.digests is None:
        images, spans, at, patches = vision.images, [], 0, 0
        index = vision.token_index.tolist()
        for (t, h, w), count in zip(images.image_grid_thw.tolist(), vision.tokens_per_image):
            digest = hashlib.sha256(repr((t, h, w)).encode())
            digest.update(images.pixel_values[patches:patches + t * h * w].contiguous().cpu().numpy().tobytes())
            spans.append((index[at], index[at + count - 1] + 1, digest.digest()))
            at, patches = at + count, patches + t * h * w
        vision.digests = tuple(spans)
    spans = vision.digests
    return lambda start, end: b"".join(d for a, b, d in spans if a < end and b > start)

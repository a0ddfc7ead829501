"""Stage 0's index of the KV blocks whose content is known: prefix caching.

A full block's identity is a SHA-256 over its parent's identity, its tokens and, for a block that
holds some of an image's tokens, the image's content hash (an image's placeholder tokens are the
same for every image of its size). Two requests whose prompts begin with the same tokens and images
have the same chain of identities, so the second finds the first one's blocks here, as long as the
pool has kept them (:class:`~stagewise.kv.block_pool.BlockPool`: held, or cached until evicted).

Only stage 0 knows tokens, so only it keeps the index. A hit needs no message of its own: the
step that starts the request names the blocks it shares
(:attr:`~stagewise.model.batch.StepBatch.prefix_blocks`), and since every stage's pool makes the
same calls in the same order, the same ids hold each stage's layers' KV of those tokens.

A block enters the index once the step that wrote it has run on every stage, so a hit never reads
KV that a later stage has yet to write, and never KV of a step that failed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stagewise.kv.block_pool import BlockPool

ROOT = b""
"""The parent identity of a sequence's first block."""


def block_hashes(tokens: Sequence[int], tokens_per_block: int, known: list[bytes],
                 extra: Callable[[int, int], bytes] | None = None) -> list[bytes]:
    """``known`` (the identities of the first blocks, already computed) extended to every full
    block of ``tokens``. ``extra(start, end)``: bytes that the tokens ``[start, end)`` stand for
    beyond their ids (the content hashes of the images they belong to), or None."""
    out = known
    for j in range(len(out), len(tokens) // tokens_per_block):
        start, end = j * tokens_per_block, (j + 1) * tokens_per_block
        h = hashlib.sha256(out[-1] if out else ROOT)
        h.update(array("q", tokens[start:end]).tobytes())
        if extra is not None:
            h.update(extra(start, end))
        out.append(h.digest())
    return out


@dataclass(kw_only=True, slots=True)
class PrefixStats:
    """What the index has done since it started (Prometheus counters and the run's stats)."""

    queried_tokens: int = 0
    """Prompt tokens of the requests that looked for a cached prefix."""
    hit_tokens: int = 0
    """Of those, the tokens found cached (not computed again)."""
    evicted_blocks: int = 0
    """Cached blocks taken back by the pool for new KV."""


class PrefixIndex:
    """Block identity -> block id, for the blocks of one pool whose KV is whole."""

    def __init__(self, pool: BlockPool, tokens_per_block: int) -> None:
        self.pool, self.tokens_per_block = pool, tokens_per_block
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.stats = PrefixStats()
        pool.on_evict = self._evicted

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, hashes: Sequence[bytes], num_tokens: int) -> list[int]:
        """The blocks of the longest cached chain of ``hashes`` that leaves at least the last of
        ``num_tokens`` prompt tokens to compute (its logits are needed)."""
        found = self.chain(hashes, num_tokens)
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += len(found) * self.tokens_per_block
        return found

    def chain(self, hashes: Sequence[bytes], num_tokens: int) -> list[int]:
        """:meth:`lookup`'s blocks, not counted in the statistics (a probe)."""
        limit = min(len(hashes), (num_tokens - 1) // self.tokens_per_block)
        found = []
        for h in hashes[:limit]:
            block = self._by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def register(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Name blocks whose KV is now whole on every stage by their identities; a block already
        named, or an identity another block has, keeps its entry."""
        for block, h in zip(blocks, hashes):
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h

    def clear(self) -> None:
        """Forget every entry (the pool keeps the blocks; nothing will find them)."""
        self._by_hash.clear()
        self._hash_of.clear()

    def _evicted(self, block: int) -> None:
        self.stats.evicted_blocks += 1
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._by_hash[h]

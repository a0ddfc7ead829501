"""Prefix caching's store and index: the pool keeps the blocks nobody holds, evicts them least
recently released first and only when no free block is left; a block's identity chains its
parent's, its tokens and what they stand for; a lookup always leaves the prompt's last token."""

from __future__ import annotations

import pytest

from stagewise.kv import BlockPool, KVCacheManager
from stagewise.kv.prefix import PrefixIndex, block_hashes


def test_cached_blocks_are_shared_kept_and_evicted_oldest_first():
    pool, evicted = BlockPool(4), []
    pool.on_evict = evicted.append
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    pool.share([0, 1])  # a second request starts with a's first two blocks
    assert pool.refs(0) == 2 and pool.num_used == 3
    pool.free(a, cache=True)  # a ends: 2 is cached, 0 and 1 still held by the other
    assert pool.is_cached(2) and pool.refs(0) == 1 and pool.num_free == 2 and pool.num_cached == 1
    pool.free([0, 1], cache=True)  # released last to first: 1 is evicted before 0
    assert pool.num_cached == 3 and pool.num_free == 4
    assert pool.allocate(1) == [3] and evicted == []  # a free block first
    assert pool.allocate(2) == [2, 1] and evicted == [2, 1]
    pool.share([0])  # a hit takes a cached block back out of the eviction order
    assert not pool.is_cached(0) and pool.refs(0) == 1 and pool.num_free == 0


def test_share_and_free_refuse_what_they_cannot_do_and_change_nothing():
    pool = BlockPool(3)
    held = pool.allocate(1)
    with pytest.raises(ValueError, match="block id 1 is free: it holds no cached KV"):
        pool.share([held[0], 1])
    assert pool.refs(held[0]) == 1
    with pytest.raises(ValueError, match=r"block id 7 is not in \[0, 3\)"):
        pool.share([7])
    pool.free(held)  # not cached: back on the free stack
    assert pool.num_cached == 0 and pool.num_free == 3
    pool.allocate(2)
    pool.reset()
    assert pool.num_free == 3 and pool.allocate(3) == [0, 1, 2]


def test_a_request_starts_after_its_cached_prefix_and_leaves_its_full_blocks_cached():
    m = KVCacheManager(block_size=4, num_blocks=8, max_blocks_per_seq=8)
    m.add("a", 10)  # blocks 0, 1 full; 2 partial
    m.free("a")
    assert m.pool.num_cached == 2 and [m.pool.is_cached(b) for b in (0, 1, 2)] == [True, True, False]
    m.share([0, 1])
    m.add("b", 9, prefix=[0, 1])
    assert m.block_ids("b")[:2] == [0, 1] and m.num_tokens("b") == 9 and m.pool.num_cached == 0
    with pytest.raises(ValueError, match="cannot start with 3 cached blocks"):
        m.add("c", 8, prefix=[0, 1, 2])
    with pytest.raises(ValueError, match="still hold KV"):
        m.reset()


def test_identities_chain_tokens_and_images():
    tokens = list(range(10))
    h = block_hashes(tokens, 4, [])
    assert len(h) == 2 and len(set(h)) == 2
    assert block_hashes(tokens[:8] + [99], 4, []) == h  # the partial block is not hashed
    assert block_hashes([1] + tokens[1:], 4, [])[1] != h[1]  # a block's identity holds its parent's
    image = block_hashes(tokens, 4, [], extra=lambda a, b: b"image-a" if a < 6 < b else b"")
    assert image[0] == h[0] and image[1] != h[1]
    known = h[:1]
    assert block_hashes(tokens, 4, known) is known and known == h  # extended in place


def test_a_lookup_leaves_the_last_token_and_forgets_evicted_blocks():
    pool = BlockPool(4)
    index = PrefixIndex(pool, 4)
    blocks = pool.allocate(3)
    hashes = block_hashes(list(range(12)), 4, [])
    index.register(blocks, hashes)
    assert index.lookup(hashes, 13) == blocks and index.lookup(hashes, 12) == blocks[:2]
    assert index.lookup(hashes, 4) == [] and index.stats.hit_tokens == 20 and index.stats.queried_tokens == 29
    pool.free(blocks, cache=True)
    pool.allocate(2)  # one free, then the oldest cached: the last block
    assert index.lookup(hashes, 13) == blocks[:2] and index.stats.evicted_blocks == 1
    index.clear()
    assert index.lookup(hashes, 13) == []

"""Sliding-window layer groups: what a manager with a window stores, keeps and gives back, the
budget stage 0 counts for it, and how the cache is split into groups and sized. The invariants are
checked against a brute-force reading of the window rule (the query at ``q`` sees ``q - W < k <= q``)
over random windows, block sizes and chunkings."""

from __future__ import annotations

import random

import pytest
import torch

from stagewise.kv import PAD_BLOCK_ID, KVCache, KVCacheManager, KVCacheSpec, OutOfKVBlocks
from stagewise.kv.budget import GroupPool, KVBudget
from stagewise.kv.cache import cache_bytes, group_blocks, num_cache_blocks
from stagewise.kv.window import blocks_touched, pool_blocks


def test_a_window_stores_keeps_and_gives_back_by_the_rule():
    m = KVCacheManager(block_size=2, num_blocks=8, max_blocks_per_seq=8, window=3)
    m.add(0, 5)  # the next query (at 5) sees 3 and 4: only their block... and 4's
    assert m.block_ids(0) == [PAD_BLOCK_ID, 0, 1] and m.kept_from(0) == 3
    assert m.slot_mapping([(0, 0, 5)]).tolist() == [-1, -1, -1, 1, 2]
    assert m.trim(0) == 0
    m.append(0, 1)  # a decode at 5 reads 3, 4 and itself; it stores 5 (block 2's second slot)
    assert m.slot_mapping([(0, 5, 1)]).tolist() == [3]
    assert m.trim(0) == 1 and m.block_ids(0) == [PAD_BLOCK_ID, PAD_BLOCK_ID, 1] and m.num_used_blocks == 1
    m.append(0, 1)
    assert m.block_ids(0) == [PAD_BLOCK_ID, PAD_BLOCK_ID, 1, 0] and m.num_used_blocks == 2
    m.free(0)
    assert m.num_free_blocks == 8 and 0 not in m


def test_a_window_refuses_context_parallel_and_bad_values():
    with pytest.raises(ValueError, match="window must be an int >= 1 or None, got 0"):
        KVCacheManager(block_size=2, num_blocks=8, max_blocks_per_seq=8, window=0)
    with pytest.raises(ValueError, match=r"a sliding window \(4\) cannot be sharded over cp_world_size=2"):
        KVCacheManager(block_size=2, num_blocks=8, max_blocks_per_seq=8, window=4, cp_world_size=2)


def _request(rng: random.Random) -> tuple[int, list[int]]:
    """A prompt's length and the tokens each of its steps brings: the prompt's chunks, then decodes."""
    prompt = left = rng.randint(1, 30)
    chunks = []
    while left:
        chunks.append(rng.randint(1, left))
        left -= chunks[-1]
    return prompt, chunks + [1] * rng.randint(0, 20)


@pytest.mark.parametrize("seed", range(40))
def test_random_requests_hold_what_the_window_needs_within_the_budget(seed):
    """Requests of random prompts, chunkings and lengths, stepped together as the executor steps
    them. At each step every position its queries read is still held, exactly the positions a later
    query sees are stored, a request never holds more than stage 0's budget reserved for it in that
    phase, and between steps it holds at most the blocks of W - 1 positions."""
    rng = random.Random(seed)
    w, bs = rng.randint(1, 9), rng.randint(1, 5)
    m = KVCacheManager(block_size=bs, num_blocks=400, max_blocks_per_seq=100, window=w)
    budget = KVBudget([GroupPool(window=None, num_blocks=400), GroupPool(window=w, num_blocks=400)],
                      block_size=bs, max_blocks_per_seq=100)
    reqs = {r: _request(rng) for r in range(4)}
    done, step = dict.fromkeys(reqs, 0), dict.fromkeys(reqs, 0)
    while any(step[r] < len(steps) for r, (_, steps) in reqs.items()):
        for r, (prompt, steps) in reqs.items():
            if step[r] == len(steps):
                continue
            n, have = steps[step[r]], done[r]
            if have == 0:
                budget.add(r, prompt)  # the scheduler reserves the whole prompt when it admits it
                m.add(r, n)
            else:
                if have >= prompt:
                    budget.append(r, n)
                m.append(r, n)
            table = m.block_ids(r)
            for p in range(max(0, have - w + 1), have):  # read by the step's queries
                assert table[p // bs] != PAD_BLOCK_ID, (p, table)
            slots = m.slot_mapping([(r, have, n)]).tolist()
            assert [s >= 0 for s in slots] == [p >= have + n - w + 1 for p in range(have, have + n)]
            assert sum(b != PAD_BLOCK_ID for b in table) <= budget.reserved(r)[1]
            done[r], step[r] = have + n, step[r] + 1
        for r in reqs:
            m.trim(r)
            assert sum(b != PAD_BLOCK_ID for b in m.block_ids(r)) <= blocks_touched(w - 1, bs)
    assert m.num_used_blocks == sum(sum(b != PAD_BLOCK_ID for b in m.block_ids(r)) for r in reqs)


def test_the_budget_reserves_a_prompt_whole_then_a_window_and_is_all_or_nothing():
    b = KVBudget([GroupPool(window=None, num_blocks=10), GroupPool(window=4, num_blocks=5)], block_size=2,
                 max_blocks_per_seq=16)
    b.add("a", 9)  # full: 5 blocks; the window: twice the blocks of 3 positions (2 each), at most
    assert b.reserved("a") == [5, 4] and b.num_free_blocks == 5
    b.append("a")  # decoding: the blocks of 4 positions, at most 3
    assert b.reserved("a") == [5, 3]
    with pytest.raises(OutOfKVBlocks, match="4 more blocks of the 4-token window needed, 2 of 5 free"):
        b.add("b", 7)
    assert "b" not in b and b.reserved("a") == [5, 3] and b.num_free_blocks == 5
    assert b.fits_at_all(40) == "needs 20 KV blocks, more than the 10 blocks of the whole KV cache"
    b.free("a")
    b.add("b", 7)
    assert b.reserved("b") == [4, 4]


def _spec(windows=(), layers=4) -> KVCacheSpec:
    return KVCacheSpec(layer_start=2, layer_end=2 + layers, num_kv_heads=2, head_dim=8, block_size=4,
                       dtype=torch.float32, windows=windows)


def test_layers_with_one_window_share_a_tensor_of_their_own():
    spec = _spec((8, None, 8, 8))
    assert spec.group_windows == (8, None) and [spec.group_of(i) for i in range(2, 6)] == [(0, 0), (1, 0), (0, 1),
                                                                                           (0, 2)]
    assert spec.bytes_per_block(0) == 3 * spec.bytes_per_block(1) and spec.bytes_per_block() == 4 * 2 * 4 * 2 * 8 * 4
    cache = KVCache(spec, num_blocks=[3, 7])
    assert [tuple(t.shape) for t in cache.storages] == [(3, 2, 3, 4, 2, 8), (1, 2, 7, 4, 2, 8)]
    k, v = cache.layer(4)[:2]
    assert k.data_ptr() == cache.storages[0][1, 0].data_ptr() and v.data_ptr() == cache.storages[0][1, 1].data_ptr()
    assert cache.nbytes == 3 * spec.bytes_per_block(0) + 7 * spec.bytes_per_block(1)
    with pytest.raises(ValueError, match=r"the layers form 2 groups \(windows \[8, None\]\)"):
        cache.storage
    with pytest.raises(ValueError, match=r"one int >= 1 or None per layer \(4\)"):
        _spec((8, None))
    with pytest.raises(ValueError, match=r"KVCache.layer: layer 6 is outside this stage's range \[2, 6\)"):
        cache.layer(6)


@pytest.mark.parametrize("windows", [(), (8, None, 8, 8), (8, 8, 8, 8), (3, None, 16, 3)])
@pytest.mark.parametrize("nbytes", [30_000, 200_000, 5_000_000])
def test_a_byte_budget_takes_the_most_blocks_that_fit(windows, nbytes):
    spec, rows = _spec(windows), dict(max_num_seqs=4, max_model_len=256)
    f = num_cache_blocks(spec, "cpu", kv_cache_bytes=nbytes, **rows)
    assert cache_bytes(spec, f, **rows) <= nbytes
    sizes = group_blocks(spec, f, **rows)
    if None in spec.group_windows:  # the full pool could still grow: one more block would not fit
        assert cache_bytes(spec, f + 1, **rows) > nbytes
    else:  # every window pool holds every row's most, or one more block would not fit
        assert cache_bytes(spec, f + 1, **rows) > nbytes or sizes == group_blocks(spec, 10**6, **rows)
    if not windows:
        assert f == nbytes // spec.bytes_per_block()
    for w, n in zip(spec.group_windows, sizes):
        assert n == pool_blocks(w, full_blocks=f, block_size=4, max_num_seqs=4, max_model_len=256) <= f


def test_a_window_pool_is_what_the_rows_can_hold_and_never_more_than_the_full_pool():
    # window 8, blocks of 4: decode 3 blocks, a prompt's chunks 2 * 3; 5 rows
    assert pool_blocks(8, full_blocks=1000, block_size=4, max_num_seqs=5, max_model_len=256) == 30
    assert pool_blocks(8, full_blocks=12, block_size=4, max_num_seqs=5, max_model_len=256) == 12
    assert pool_blocks(8, full_blocks=1000, block_size=4, max_num_seqs=5, max_model_len=8) == 10  # 2 blocks a row
    assert pool_blocks(None, full_blocks=1000, block_size=4, max_num_seqs=5, max_model_len=256) == 1000
    assert pool_blocks(8, full_blocks=1000, block_size=4, max_num_seqs=None, max_model_len=256) == 1000

"""stagewise.kv: block pool, per-request bookkeeping and the paged K/V tensors,
checked against plain Python computations of the expected state."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.kernels import DTYPES
from stagewise.kv import PAD_BLOCK_ID, BlockPool, KVCache, KVCacheManager, KVCacheSpec, OutOfKVBlocks
from stagewise.ops import reference


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def plain_slot(blocks: list[int], pos: int, block_size: int, cp: int = 1, rank: int = 0, inter: int = 1) -> int:
    """The context-parallel slot of one position, written out for one request (cache.h)."""
    vbs = block_size * cp
    off = pos % vbs
    local_block = off // inter
    if local_block % cp != rank:
        return -1
    return blocks[pos // vbs] * block_size + (local_block // cp) * inter + off % inter


def check_accounting(m: KVCacheManager, expected_tokens: dict) -> None:
    """Every request holds ceil(tokens / tokens_per_block) distinct blocks; the pool agrees."""
    held = []
    for rid, n in expected_tokens.items():
        assert m.num_tokens(rid) == n
        ids = m.block_ids(rid)
        assert len(ids) == ceil_div(n, m.block_size * m.cp_world_size)
        held.extend(ids)
    assert len(set(held)) == len(held), "a block is held by two requests"
    assert len(m) == len(expected_tokens)
    assert m.num_free_blocks == m.pool.num_blocks - len(held)


# ---- BlockPool ---------------------------------------------------------------


def test_pool_allocate_free_reuse():
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 2
    b = pool.allocate(2)
    assert set(a).isdisjoint(b) and pool.num_free == 0
    pool.free(a)
    assert pool.num_free == 3
    assert sorted(pool.allocate(3)) == sorted(a)  # freed blocks are reused
    assert pool.allocate(0) == []


def test_pool_exhaustion_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(OutOfKVBlocks) as err:
        pool.allocate(2)
    assert (err.value.needed, err.value.free) == (2, 1)
    assert pool.num_free == 1
    assert len(pool.allocate(1)) == 1


@pytest.mark.parametrize(
    "bad, why",
    [([0, 7], "not in"), ([0, -1], "not in"), ([1, 1], "already free"), ([0, 3], "already free")],
)
def test_pool_bad_free_changes_nothing(bad, why):
    """Foreign ids, a repeated id and an id that is already free (3) are refused
    before anything is freed."""
    pool = BlockPool(4)
    held = pool.allocate(3)
    assert sorted(held) == [0, 1, 2]
    with pytest.raises(ValueError, match=f"BlockPool.free: block id .* {why}"):
        pool.free(bad)
    assert pool.num_free == 1
    pool.free(held)
    assert pool.num_free == 4


def test_pool_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(-1)
    with pytest.raises(ValueError, match="n must be"):
        BlockPool(2).allocate(-1)


# ---- KVCacheManager ----------------------------------------------------------


def test_growth_allocates_at_block_boundaries():
    m = KVCacheManager(block_size=4, num_blocks=8, max_blocks_per_seq=8)
    m.add("r", 0)
    check_accounting(m, {"r": 0})
    for n in range(1, 21):
        m.append("r")
        check_accounting(m, {"r": n})
    m.append("r", 7)
    check_accounting(m, {"r": 27})
    m.free("r")
    check_accounting(m, {})
    assert m.num_free_blocks == 8


def test_exhaustion_leaves_everything_untouched_and_pool_reusable():
    m = KVCacheManager(block_size=4, num_blocks=5, max_blocks_per_seq=10)
    m.add("a", 9)  # 3 blocks
    m.add("b", 4)  # 1 block
    before = {"a": m.block_ids("a"), "b": m.block_ids("b")}
    assert not m.can_admit(9)
    with pytest.raises(OutOfKVBlocks):
        m.add("c", 9)
    assert "c" not in m
    with pytest.raises(OutOfKVBlocks):
        m.append("b", 9)  # needs 2 more, 1 free
    check_accounting(m, {"a": 9, "b": 4})
    assert {"a": m.block_ids("a"), "b": m.block_ids("b")} == before
    m.free("a")
    assert m.can_admit(9)
    m.add("c", 9)
    # Free blocks first (a's partial last block, then 4, never taken), then the cached ones: a's
    # full blocks, its later one (1) evicted before the one its prefix begins with (0).
    assert m.block_ids("c") == [2, 4, 1] and m.pool.is_cached(0)
    check_accounting(m, {"b": 4, "c": 9})


def test_errors_name_request_and_numbers():
    m = KVCacheManager(block_size=4, num_blocks=100, max_blocks_per_seq=3)
    assert m.max_model_len == 12
    m.add("a", 12)
    with pytest.raises(ValueError, match=r"request 'a'.*13 tokens.*max_model_len=12"):
        m.append("a")
    with pytest.raises(ValueError, match=r"request 'b'.*13 tokens.*max_model_len=12"):
        m.add("b", 13)
    assert not m.can_admit(13) and m.can_admit(12)
    with pytest.raises(ValueError, match=r"request 'a' is already registered"):
        m.add("a", 1)
    for call in (lambda: m.append("zz"), lambda: m.free("zz"), lambda: m.num_tokens("zz"),
                 lambda: m.block_tables(["zz"]), lambda: m.slot_mapping([("zz", 0, 1)])):
        with pytest.raises(ValueError, match="unknown request 'zz'"):
            call()
    with pytest.raises(ValueError, match=r"positions \[10, 13\) of request 'a'.*12 allocated"):
        m.slot_mapping([("a", 10, 3)])
    check_accounting(m, {"a": 12})


@pytest.mark.parametrize(
    "kwargs",
    [dict(block_size=0), dict(num_blocks=-1), dict(max_blocks_per_seq=0), dict(cp_world_size=2, cp_rank=2),
     dict(block_size=6, interleave_size=4)],
)
def test_manager_rejects_bad_config(kwargs):
    args = dict(block_size=4, num_blocks=4, max_blocks_per_seq=4) | kwargs
    with pytest.raises(ValueError, match="KVCacheManager"):
        KVCacheManager(**args)


def test_block_tables_and_slot_mapping_equal_plain_computation(device):
    m = KVCacheManager(block_size=4, num_blocks=16, max_blocks_per_seq=5)
    lengths = {"a": 9, "b": 1, "c": 0, "d": 16}
    for rid, n in lengths.items():
        m.add(rid, n)
    m.free("b")  # leave a hole so ids are not simply consecutive
    m.add("b", 6)
    lengths["b"] = 6
    order = ["d", "c", "a", "b"]
    table = m.block_tables(order, device)
    assert table.dtype == torch.int32 and table.device.type == device and table.shape == (4, 5)
    for row, rid in enumerate(order):
        ids = m.block_ids(rid)
        assert table[row].tolist() == ids + [PAD_BLOCK_ID] * (5 - len(ids))
    # A prefill chunk, two decode tokens and a span of the same request again.
    spans = [("a", 3, 6), ("d", 15, 1), ("b", 0, 6), ("a", 0, 2), ("c", 0, 0)]
    slots = m.slot_mapping(spans, device)
    expected = [plain_slot(m.block_ids(r), p, 4) for r, first, n in spans for p in range(first, first + n)]
    assert slots.dtype == torch.int64 and slots.device.type == device
    assert slots.tolist() == expected
    assert m.slot_mapping([], device).tolist() == []


@pytest.mark.parametrize("cp, inter", [(2, 1), (2, 2), (3, 4)])
def test_context_parallel_bookkeeping(cp, inter):
    """Each rank holds ceil(n / (block_size*cp)) blocks; the ranks' slots together
    cover every position exactly once; local token counts match the owned slots."""
    block_size, n = 4, 29
    ranks = [KVCacheManager(block_size=block_size, num_blocks=8, max_blocks_per_seq=4, cp_world_size=cp,
                            cp_rank=r, interleave_size=inter) for r in range(cp)]
    assert ranks[0].max_model_len == 4 * block_size * cp
    owners = [0] * n
    for r, m in enumerate(ranks):
        m.add("x", n - 3)
        m.append("x", 3)
        check_accounting(m, {"x": n})
        slots = m.slot_mapping([("x", 0, n)]).tolist()
        assert slots == [plain_slot(m.block_ids("x"), p, block_size, cp, r, inter) for p in range(n)]
        stored = [s for s in slots if s >= 0]
        assert len(set(stored)) == len(stored)
        assert m.num_local_tokens("x") == len(stored)
        # Local tokens fill this rank's blocks in order: the j-th owned position
        # sits at local index j of the block table, as decode_attention reads it.
        ids = m.block_ids("x")
        assert stored == [ids[j // block_size] * block_size + j % block_size for j in range(len(stored))]
        for p, s in enumerate(slots):
            owners[p] += s >= 0
    assert owners == [1] * n


def test_num_local_tokens_at_every_length():
    for cp, inter, block_size in [(1, 1, 4), (2, 1, 4), (2, 2, 4), (4, 2, 2), (3, 1, 3)]:
        for rank in range(cp):
            m = KVCacheManager(block_size=block_size, num_blocks=64, max_blocks_per_seq=8, cp_world_size=cp,
                               cp_rank=rank, interleave_size=inter)
            m.add("x", 0)
            for n in range(1, m.max_model_len + 1):
                m.append("x")
                owned = sum(plain_slot(m.block_ids("x"), p, block_size, cp, rank, inter) >= 0 for p in range(n))
                assert m.num_local_tokens("x") == owned, (cp, inter, block_size, rank, n)


def test_randomized_interleaving_against_a_model():
    rng = random.Random(1234)
    block_size, num_blocks, max_blocks = 4, 40, 6
    m = KVCacheManager(block_size=block_size, num_blocks=num_blocks, max_blocks_per_seq=max_blocks)
    model: dict[int, int] = {}  # request -> tokens
    next_id = 0
    for _ in range(3000):
        op = rng.random()
        free_blocks = num_blocks - sum(ceil_div(n, block_size) for n in model.values())
        if op < 0.25 or not model:
            n = rng.randint(0, max_blocks * block_size + 2)
            fits = ceil_div(n, block_size) <= max_blocks
            enough = ceil_div(n, block_size) <= free_blocks
            assert m.can_admit(n) == (fits and enough)
            if not fits:
                with pytest.raises(ValueError):
                    m.add(next_id, n)
            elif not enough:
                with pytest.raises(OutOfKVBlocks):
                    m.add(next_id, n)
            else:
                m.add(next_id, n)
                model[next_id] = n
            next_id += 1
        elif op < 0.85:
            rid = rng.choice(list(model))
            k = rng.choice([1, 1, 1, 2, 5])
            need = ceil_div(model[rid] + k, block_size) - ceil_div(model[rid], block_size)
            if ceil_div(model[rid] + k, block_size) > max_blocks:
                with pytest.raises(ValueError):
                    m.append(rid, k)
            elif need > free_blocks:
                with pytest.raises(OutOfKVBlocks):
                    m.append(rid, k)
            else:
                m.append(rid, k)
                model[rid] += k
        else:
            rid = rng.choice(list(model))
            m.free(rid)
            del model[rid]
        check_accounting(m, model)
    # Slots of all live requests are distinct and inside the pool.
    spans = [(rid, 0, n) for rid, n in model.items()]
    slots = m.slot_mapping(spans).tolist()
    assert len(set(slots)) == len(slots) and all(0 <= s < num_blocks * block_size for s in slots)


# ---- KVCache -----------------------------------------------------------------


def spec(**kw) -> KVCacheSpec:
    args = dict(layer_start=3, layer_end=7, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.bfloat16)
    return KVCacheSpec(**(args | kw))


def test_bytes_per_block_and_sizing_modes():
    s = spec()
    per_block = 2 * 4 * 16 * 2 * 8 * 2  # K and V, 4 layers, 16 slots, 2 heads, dim 8, 2-byte bfloat16
    assert s.bytes_per_block() == per_block == 4096
    assert spec(dtype=torch.float32).bytes_per_block() == 2 * per_block
    assert KVCache(s, num_blocks=3).num_blocks == 3
    assert KVCache(s, kv_cache_bytes=per_block * 5 + per_block - 1).num_blocks == 5
    assert KVCache(s, kv_cache_bytes=per_block).num_blocks == 1
    with pytest.raises(ValueError, match="holds no block"):
        KVCache(s, kv_cache_bytes=per_block - 1)
    assert KVCache(s, max_num_tokens=16).num_blocks == 1
    assert KVCache(s, max_num_tokens=17).num_blocks == 2
    assert KVCache(s, max_num_tokens=1).num_blocks == 1
    c = KVCache(s, num_blocks=5)
    assert c.nbytes == 5 * per_block
    for layer in range(3, 7):
        k, v = c.layer(layer)[:2]
        assert k.shape == v.shape == (5, 16, 2, 8) and k.is_contiguous() and v.is_contiguous()
        assert k.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"layer 7 is outside this stage's range \[3, 7\)"):
        c.layer(7)
    with pytest.raises(ValueError, match="exactly one"):
        KVCache(s, num_blocks=2, max_num_tokens=3)
    with pytest.raises(ValueError, match="exactly one"):
        KVCache(s)


@pytest.mark.parametrize("kwargs, field", [(dict(layer_end=3), "layer_end"), (dict(num_kv_heads=0), "num_kv_heads"),
                                           (dict(dtype=torch.int8), "dtype"), (dict(block_size=0), "block_size")])
def test_spec_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"KVCacheSpec: {field}"):
        spec(**kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_then_read_back_through_block_tables(device, dtype):
    s = spec(layer_start=0, layer_end=2, num_kv_heads=3, head_dim=5, block_size=4, dtype=dtype)
    cache = KVCache(s, num_blocks=12, device=device)
    m = KVCacheManager(block_size=4, num_blocks=12, max_blocks_per_seq=6)
    lengths = {"a": 7, "b": 13, "c": 1}
    written = {(layer, rid): ([], []) for layer in range(2) for rid in lengths}

    def step(spans):
        slots = m.slot_mapping(spans, device)
        for layer in range(2):
            k = torch.randn(slots.numel(), 3, 5, device=device).to(dtype)
            v = torch.randn(slots.numel(), 3, 5, device=device).to(dtype)
            cache.write(layer, k, v, slots)
            t = 0
            for rid, _, n in spans:
                written[layer, rid][0].append(k[t : t + n])
                written[layer, rid][1].append(v[t : t + n])
                t += n

    for rid, n in lengths.items():  # prefill, one request at a time
        m.add(rid, n)
    step([(rid, 0, n) for rid, n in lengths.items()])
    for _ in range(5):  # decode steps, all requests batched
        for rid in lengths:
            m.append(rid)
            lengths[rid] += 1
        step([(rid, lengths[rid] - 1, 1) for rid in lengths])
    rids = list(lengths)
    table = m.block_tables(rids, device)
    for layer in range(2):
        k_cache, v_cache = cache.layer(layer)[:2]
        for row, rid in enumerate(rids):
            k, v = reference.gather_kv(k_cache, v_cache, table[row], lengths[rid])
            assert torch.equal(k, torch.cat(written[layer, rid][0]))
            assert torch.equal(v, torch.cat(written[layer, rid][1]))

"""StepMetadata gives, step after step, the tensors KVMetadata.build gives afresh: decode steps
advanced in place within their blocks, rebuilt across block boundaries, for several batches
taking turns (microbatch groups), after a request ended, with sliding windows and context
parallelism (which always rebuild), through the CPU buffers and through ``add_``."""

from __future__ import annotations

import random

import pytest
import torch

from stagewise.engine import step_meta
from stagewise.engine.step_meta import StepMetadata
from stagewise.kv import KVCacheManager
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata

BLOCK = 4


def decode_batch(manager: KVCacheManager, ids: tuple[int, ...]) -> StepBatch:
    """One decode step of ``ids``: each grows by a slot, as the executor does before building."""
    ctx = [manager.num_tokens(r) for r in ids]
    for r in ids:
        manager.append(r, 1)
    return StepBatch(request_ids=ids, num_prefills=0, query_lens=[1] * len(ids), context_lens=ctx,
                     positions=torch.tensor(ctx), token_ids=torch.zeros(len(ids), dtype=torch.int64))


def same(a: KVMetadata, b: KVMetadata) -> bool:
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("slot_mapping", "block_tables", "seq_lens"))


@pytest.mark.parametrize("kind", ["plain", "add_", "window", "cp"])
def test_matches_a_fresh_build_step_after_step(kind, monkeypatch):
    if kind == "add_":
        monkeypatch.setattr(step_meta, "BUFFER_ROWS", 0)
    options = {"window": {"window": 6}, "cp": {"cp_world_size": 2, "cp_rank": 1}}.get(kind, {})
    manager = KVCacheManager(block_size=BLOCK, num_blocks=200, max_blocks_per_seq=16, **options)
    meta = StepMetadata(manager, torch.device("cpu"))
    rng = random.Random(0)
    for rid in range(6):
        manager.add(rid, rng.randint(1, 9))
    groups = [(0,), (1, 2), (3, 4, 5)]  # batches that take turns, as microbatch groups do
    reused = 0
    for step in range(30):
        ids = groups[step % len(groups)]
        if step == 17:  # request 2 ends; its group goes on without it
            manager.free(2)
            meta.forget([2])
            groups[1] = (1,)
            ids = groups[1]
        batch = decode_batch(manager, ids)
        before = len(meta._entries)
        got = meta.build(batch)
        reused += len(meta._entries) == before and step >= len(groups)
        assert same(got, KVMetadata.build(batch, manager, "cpu")), f"step {step}"
    if kind in ("plain", "add_"):
        assert reused > 10  # most steps advanced in place
    else:
        assert not meta._entries  # these layouts always build afresh


def test_a_prefill_or_a_different_batch_builds_afresh():
    manager = KVCacheManager(block_size=BLOCK, num_blocks=50, max_blocks_per_seq=16)
    meta = StepMetadata(manager, torch.device("cpu"))
    manager.add(0, 1)
    manager.add(1, 2)
    first = meta.build(decode_batch(manager, (0,)))  # position 1
    second = meta.build(decode_batch(manager, (0,)))  # position 2, in the same block
    assert second is first  # the same tensors, advanced
    assert meta.build(decode_batch(manager, (0,))) is first  # position 3
    crossing = decode_batch(manager, (0,))  # position 4: a new block
    assert meta.build(crossing) is not first
    assert same(meta.build(crossing := decode_batch(manager, (0,))), KVMetadata.build(crossing, manager, "cpu"))
    both = decode_batch(manager, (0, 1))
    assert same(meta.build(both), KVMetadata.build(both, manager, "cpu"))
    manager.add(2, 5)
    prefill = StepBatch(request_ids=(2,), num_prefills=1, query_lens=[5], context_lens=[0],
                        positions=torch.arange(5), token_ids=torch.zeros(5, dtype=torch.int64))
    assert same(meta.build(prefill), KVMetadata.build(prefill, manager, "cpu"))
    # A step that skipped a position (the request was not in the last one) is not advanced.
    manager.append(0, 1)
    skipped = decode_batch(manager, (0,))
    assert same(meta.build(skipped), KVMetadata.build(skipped, manager, "cpu"))


def test_remembers_a_bounded_number_of_batches():
    manager = KVCacheManager(block_size=BLOCK, num_blocks=200, max_blocks_per_seq=8)
    meta = StepMetadata(manager, torch.device("cpu"))
    for rid in range(step_meta.MAX_ENTRIES + 3):
        manager.add(rid, 1)
        meta.build(decode_batch(manager, (rid,)))
    assert len(meta._entries) == step_meta.MAX_ENTRIES
    assert (0,) not in meta._entries and (step_meta.MAX_ENTRIES + 2,) in meta._entries

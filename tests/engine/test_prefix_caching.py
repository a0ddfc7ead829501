"""Stage 0's prefix caching without a model: a queued request waits exactly while an admitted one
computes the block it would find next, and no longer once that block is registered, its request
ended, or the cache was reset or paused."""

from __future__ import annotations

from stagewise.engine.prefix_cache import PrefixCaching
from stagewise.engine.scheduler import SeqState
from stagewise.kv import KVCacheManager

SHARED = list(range(100, 108))  # two blocks of 4


def _admitted(cache: PrefixCaching, seq: SeqState) -> SeqState:
    cache.lookup(seq)
    cache.manager.add(seq.request_id, len(seq.prompt_ids), prefix=list(seq.prefix_blocks))
    return seq


def test_a_queued_request_waits_for_the_block_it_would_find_next():
    cache = PrefixCaching(KVCacheManager(block_size=4, num_blocks=32, max_blocks_per_seq=8), lambda rid: None)
    queued, stranger = SeqState(request_id="b", prompt_ids=SHARED + [4, 5]), SeqState(request_id="s", prompt_ids=[7] * 9)
    assert not cache.waits(queued)  # nothing admitted
    a = _admitted(cache, SeqState(request_id="a", prompt_ids=SHARED + [1, 2, 3]))
    assert cache.waits(queued) and not cache.waits(stranger)
    cache.written(a, 4)  # a's first block is registered: the queued one would find it, and waits for the next
    assert cache.waits(queued)
    cache.written(a, 8)
    assert not cache.waits(queued)  # both blocks cached: nothing more to wait for
    b = _admitted(cache, queued)
    assert b.cached_tokens == 8

    late = SeqState(request_id="d", prompt_ids=list(range(200, 212)))
    c = _admitted(cache, SeqState(request_id="c", prompt_ids=list(range(200, 210)) + [9]))
    assert cache.waits(late)
    cache.forget(c.request_id)  # c ended before its step came back: it computes nothing now
    assert not cache.waits(late)

    c = _admitted(cache, SeqState(request_id="c2", prompt_ids=list(range(200, 210)) + [9]))
    cache.written(c, 4)
    cache.reset()  # the index is emptied: c registers its blocks again with its next step
    assert cache.waits(late)
    cache.written(c, 8)
    cache.out_of_step()  # pools out of step: no lookups, no waits until they are reset
    assert not cache.waits(late)
    cache.resumed()
    assert cache.waits(late)
    cache.written(c, 8)
    assert not cache.waits(late)
    for rid in ("a", "b", "c2"):
        cache.forget(rid)
    assert not cache.waits(late)

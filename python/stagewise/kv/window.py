"""What a sliding-window layer group keeps of a request's KV, and the blocks it needs for that.

A layer with window ``W`` lets the query at position ``q`` see the keys ``q - W < k <= q``. Its
cache therefore keeps, of a request that has ``N`` tokens, only positions ``>= N - W + 1``: the
oldest key the next query (at ``N``) sees. A step that brings tokens ``[have, N)`` reads the
cached ``[have - W + 1, have)`` and passes its own K/V to attention directly, so it stores only
the positions a later query sees, ``[max(have, N - W + 1), N)``; after the step the blocks wholly
before ``N - W + 1`` go back to the pool (:meth:`~stagewise.kv.KVCacheManager.trim`).

So one request holds at most

* between steps: the blocks of ``W - 1`` consecutive positions;
* during a decode step: those of ``W`` positions (the window and the new token);
* during a prefill chunk: those of ``W - 1`` positions read and of at most ``W - 1`` stored,

and :func:`reservation` is what stage 0's scheduler counts for it (:mod:`stagewise.kv.budget`):
never less than any stage holds, so what it admits every stage can allocate.

Layer groups: the layers of a stage with the same window (None: full attention) share one block
pool and block table. A full-attention group has the stage's ``full_blocks``; a window group needs
no more than every row holding its most (:func:`pool_blocks`), and never more than the full group,
so beside full-attention layers it never refuses what the full group admits.
"""

from __future__ import annotations


def blocks_touched(n: int, block_size: int) -> int:
    """The most blocks ``n`` consecutive positions can lie in, whatever block offset they start at."""
    return 0 if n <= 0 else (n + 2 * block_size - 2) // block_size


def reservation(window: int | None, block_size: int, num_tokens: int, *, decoding: bool,
                tokens_per_block: int | None = None) -> int:
    """Blocks a request of ``num_tokens`` tokens may hold in a group: ``ceil(n / tokens_per_block)``
    without a window (``tokens_per_block``: ``block_size`` times the context-parallel ranks), at most
    the cap of its phase with one (a prompt's chunks, or decode steps)."""
    per_block = block_size if tokens_per_block is None else tokens_per_block
    full = -(-num_tokens // per_block)
    if window is None:
        return full
    return min(full, cap(window, block_size, decoding=decoding))


def cap(window: int, block_size: int, *, decoding: bool) -> int:
    """The most blocks one request holds in a group of ``window`` (see the module's docstring)."""
    return blocks_touched(window, block_size) if decoding else 2 * blocks_touched(window - 1, block_size)


def pool_blocks(window: int | None, *, full_blocks: int, block_size: int, max_num_seqs: int | None,
                max_model_len: int) -> int:
    """Blocks of a group's pool on every stage: ``full_blocks`` without a window; with one, at most
    every row's largest reservation (``max_num_seqs`` rows; None: ``full_blocks``)."""
    if window is None or max_num_seqs is None:
        return full_blocks
    most = max(cap(window, block_size, decoding=True), cap(window, block_size, decoding=False))
    per_row = min(-(-max_model_len // block_size), most)
    return max(1, min(full_blocks, max_num_seqs * per_row))

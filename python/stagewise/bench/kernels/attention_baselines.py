"""The pure-torch baselines of the attention cases of ``stagewise bench kernels``, over the same
paged cache as ours (``[num_blocks, block_size, Hk, D]``, a block table per sequence).

- :func:`torch_decode_attention`, :func:`torch_extend_attention`: the ``ref`` column (the one
  torch.compile compiles).
- :func:`sdpa_decode_attention`: what a serving engine without a paged kernel does, each
  sequence's pages gathered into contiguous K/V (:func:`gather_pages`, timed with it) and then
  ``scaled_dot_product_attention``.
- :func:`flex_decode`, :func:`flex_extend`: FlexAttention over the same gathered K/V, the lengths
  (and the causal bound) a block mask made once, as a serving step would make it once for all its
  layers; the gather is timed. torch's ``torch.nn.attention.experimental._paged_attention``
  (private, experimental) reads pages in place through flex, but from a heads-first cache
  ``[1, Hk, pages * page, D]`` whose page is flex's KV block (128 tokens by default): not our
  cache's layout.

:func:`decode_baselines` and :func:`extend_baselines` give a case its further baselines: a
callable returning ``out`` (to be checked against ours, then timed) or why there is none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

# The comparison the target asks for is on the GPU; on the CPU, compiled flex is a C++ build per shape.
FLEX_NOTE_CPU = "n/a: CUDA only (Triton)"


def torch_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_new=None, v_new=None):
    """Vectorised pure-torch decode attention (the baseline of decode_attention).

    q ``[B, Hq, D]``; caches ``[num_blocks, block_size, Hk, D]``; block_tables
    ``[B, max_blocks]``; seq_lens ``[B]``; k_new/v_new ``[B, Hk, D]`` or None.
    Returns out ``[B, Hq, D]`` in q's dtype and lse ``[B, Hq]`` float32.
    Every sequence is padded to the block table's capacity and masked by its
    length: no host sync, static shapes, so it also compiles with dynamic=False.
    GQA uses a ``[Hk, Hq / Hk]`` view of the query heads, the expansion of K/V
    to Hq heads without copying them.
    """
    b, hq, d = q.shape
    num_blocks, block_size, hk, _ = k_cache.shape
    blocks = block_tables.long().clamp(0, num_blocks - 1)  # entries past seq_len may be anything
    k = k_cache[blocks].flatten(1, 2)  # [B, Lmax, Hk, D]
    v = v_cache[blocks].flatten(1, 2)
    valid = torch.arange(k.size(1), device=q.device)[None, :] < seq_lens[:, None].long()  # [B, Lmax]
    if k_new is not None:
        k, v = torch.cat([k, k_new[:, None]], 1), torch.cat([v, v_new[:, None]], 1)
        valid = torch.cat([valid, valid.new_ones(b, 1)], 1)
    qg = q.float().view(b, hk, hq // hk, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k.float()) * scale  # [B, Hk, G, L] float32
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)  # -inf where nothing is attended
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bhgl,blhd->bhgd", probs, v.float())
    return out.reshape(b, hq, d).to(q.dtype), lse.reshape(b, hq)


def torch_extend_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
    """Pure-torch attention of runs after a cache (the baseline of extend_attention): per sequence,
    its cached K/V gathered whole blocks at a time, then SDPA with the causal mask offset by the
    cached length."""
    outs = []
    for b in range(block_tables.size(0)):
        start, end, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        blocks = block_tables[b, : -(-n // k_cache.size(1))].long()
        k, v = (c[blocks].flatten(0, 1)[:n].transpose(0, 1)[None] for c in (k_cache, v_cache))
        keys, queries = torch.arange(n, device=q.device), torch.arange(n - end + start, n, device=q.device)
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], k, v, scale=scale,
                                           attn_mask=keys <= queries[:, None], enable_gqa=True)  # fmt: skip
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, new: torch.Tensor | None = None) -> torch.Tensor:
    """Every sequence's pages of ``cache [num_blocks, block_size, Hk, D]`` in table order, then
    ``new [B, Hk, D]`` when given: ``[B, max_blocks * block_size (+ 1), Hk, D]``, contiguous.

    One pass: the pages are indexed straight into the buffer that also holds the new token (a
    ``cat`` afterwards would copy the whole gather again). Table entries past a sequence's
    length may be anything (clamped into range); the tokens they give are masked by the caller.
    """
    bsz, max_blocks = block_tables.shape
    cap = max_blocks * cache.size(1)
    out = cache.new_empty(bsz, cap + (new is not None), *cache.shape[2:])
    blocks = block_tables.long().clamp(0, cache.size(0) - 1)
    torch.ops.aten.index.Tensor_out(cache, [blocks], out=out[:, :cap].unflatten(1, (max_blocks, cache.size(1))))
    if new is not None:
        out[:, cap] = new
    return out


def _decode_keys(k_cache, block_tables, seq_lens, k_new) -> torch.Tensor:
    """``[B, L]`` bool, the gathered positions each sequence attends: its cached tokens and the
    new one (last)."""
    cap = block_tables.size(1) * k_cache.size(1)
    pos = torch.arange(cap + (k_new is not None), device=k_cache.device)
    return (pos[None, :] < seq_lens[:, None].long()) | (pos[None, :] >= cap)


def sdpa_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_new=None, v_new=None):
    """Decode attention as SDPA over the gathered pages: ``out [B, Hq, D]`` in q's dtype.

    Arguments as :func:`torch_decode_attention`'s. GQA: with one query token per sequence, a KV
    head's group of query heads becomes its query rows (``q`` viewed ``[B, Hk, Hq / Hk, D]``), so K/V
    are neither repeated nor left to ``enable_gqa``, which the masked (memory-efficient) kernel
    lacks. A sequence with nothing to attend to gets NaN, SDPA's convention (never benchmarked).
    """
    b, hq, d = q.shape
    hk = k_cache.size(2)
    k = gather_pages(k_cache, block_tables, k_new).transpose(1, 2)  # [B, Hk, L, D], D contiguous
    v = gather_pages(v_cache, block_tables, v_new).transpose(1, 2)
    mask = _decode_keys(k_cache, block_tables, seq_lens, k_new)[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(q.view(b, hk, hq // hk, d), k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, hq, d)


@functools.cache
def compiled_flex() -> Callable:
    """``flex_attention`` under torch.compile, once per process (its docs: eager is a slow, unfused
    reference). One graph per shape (dynamic=False), as the compile column's."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_new=None, v_new=None, *,
                flex: Callable) -> Callable[[], torch.Tensor]:  # fmt: skip
    """A call of FlexAttention (``flex``: compiled or not) over the gathered pages, returning
    ``out [B, Hq, D]``; its block mask (the lengths, the new token) is made here, once."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, hq, d = q.shape
    cap = block_tables.size(1) * k_cache.size(1)
    lens = seq_lens.long()
    has_new = k_new is not None

    def attended(b_, h, q_idx, kv_idx):
        return (kv_idx < lens[b_]) | ((kv_idx >= cap) & has_new)

    block_mask = create_block_mask(attended, b, None, 1, cap + has_new, device=q.device)

    def run():
        k = gather_pages(k_cache, block_tables, k_new).transpose(1, 2)  # [B, Hk, L, D]
        v = gather_pages(v_cache, block_tables, v_new).transpose(1, 2)
        out = flex(q[:, :, None], k, v, block_mask=block_mask, scale=scale, enable_gqa=True)  # [B, Hq, 1, D]
        return out[:, :, 0]

    return run


def flex_extend(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, *,
                flex: Callable) -> Callable[[], torch.Tensor]:  # fmt: skip
    """A call of FlexAttention over every sequence's gathered pages at once, returning
    ``out [T, Hq, D]``: the runs packed as one batch row, a document mask keeping each token to its
    own sequence's keys up to itself. The mask is made here, once (one host sync, for T)."""
    from torch.nn.attention.flex_attention import create_block_mask

    t = q.size(0)
    cap = block_tables.size(1) * k_cache.size(1)
    starts, lens = query_start_loc.long(), seq_lens.long()
    rows = torch.arange(t, device=q.device)
    seq_of = torch.searchsorted(starts[1:], rows, right=True)  # [T] the sequence of each query row
    pos_of = rows - starts[seq_of] + lens[seq_of] - (starts[seq_of + 1] - starts[seq_of])  # its position

    def attended(b_, h, q_idx, kv_idx):
        return (kv_idx // cap == seq_of[q_idx]) & (kv_idx % cap <= pos_of[q_idx])

    block_mask = create_block_mask(attended, 1, None, t, block_tables.size(0) * cap, device=q.device)

    def run():
        k = gather_pages(k_cache, block_tables).flatten(0, 1).transpose(0, 1)[None]  # [1, Hk, B * cap, D]
        v = gather_pages(v_cache, block_tables).flatten(0, 1).transpose(0, 1)[None]
        out = flex(q.transpose(0, 1)[None], k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)  # [T, Hq, D]

    return run


def _flex(build: Callable[[Callable], Callable], device: torch.device) -> Callable | str:
    if device.type != "cuda":
        return FLEX_NOTE_CPU
    try:
        return build(compiled_flex())  # compiles at its first call (the check against ours)
    except Exception as e:  # flex missing from this torch; a block mask it cannot make
        return f"n/a: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def decode_baselines(args: tuple) -> dict[str, Callable | str]:
    """decode_attention's further baselines over ``args`` (ours' positional arguments)."""
    return {"sdpa": lambda: sdpa_decode_attention(*args),
            "flex": _flex(lambda flex: flex_decode(*args, flex=flex), args[0].device)}  # fmt: skip


def extend_baselines(args: tuple) -> dict[str, Callable | str]:
    """extend_attention's further baselines: FlexAttention (its ref is already SDPA)."""
    return {"sdpa": "= ref (SDPA)",
            "flex": _flex(lambda flex: flex_extend(*args, flex=flex), args[0].device)}  # fmt: skip

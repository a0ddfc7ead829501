"""Self-attention over the paged KV cache: rotary, prompts by extend attention, decode by
flash-decoding.

Every token's K/V is written to the cache first (:func:`stagewise.ops.reshape_and_cache`). A step's
prompt rows (a prompt from its first token, a later chunk of a chunked prefill, a prefix-cache
hit, the drafts a row verifies) are runs of tokens after their request's cache: they attend
causally over the cache, themselves included, with :func:`stagewise.ops.extend_attention`, one
call for every run, whose tokens share each K/V row they read. Decode requests attend with
:func:`stagewise.ops.decode_attention` over their cached tokens plus the new token's k/v passed
as ``k_new/v_new``. The C++ layer loop (:mod:`stagewise.model.decode_stack`) runs the same ops.

A compact cache (``kv_cache_dtype`` int8 or fp8_e4m3: codes with a scale per token and KV head)
is read as stored by every query: prompt runs read the codes through ``extend_attention``, and a
decode row reads its own new K/V from the cache too (``seq_lens + 1``, no ``k_new``). So a prompt's
tokens come out the same however it is chunked, cached or laid out.

Under tensor parallelism a rank runs its own query heads and KV heads (the loader gives it those
rows of q, k and v) against its own cache, and the output projection's partial sums are reduced
by its :class:`RowParallelLinear`.

A layer with a sliding ``window`` (Mistral's, Gemma's sliding layers) lets the query at position
``q`` see the keys ``k`` with ``q - window < k <= q``, as transformers' sliding mask does: in
prefill through an SDPA mask over the chunk and the cached tokens its window reaches (its cache
does not keep a long chunk's first tokens, which extend attention would read),
in decode through :func:`stagewise.ops.decode_attention`'s ``window``. Its cache (a pool of its
own, :mod:`stagewise.kv.window`) holds only the tokens the window still reaches: a step stores
the positions a later query sees (the slot mapping skips the others), and the blocks before the
window are given back after each step.

Under context parallelism (``groups.cp_size > 1``) each rank stores a share of every request's
cached sequence and attention is :func:`~stagewise.model.layers.context_parallel.cp_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stagewise import ops
from stagewise.kv.cache import LayerKV, as_stored
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata
from stagewise.model.collectives import StageGroups
from stagewise.model.config import ModelConfig
from stagewise.model.layers.context_parallel import check_groups, cp_attention
from stagewise.model.layers.linear import Linear, RowParallelLinear
from stagewise.model.layers.rotary import Rotary
from stagewise.model.rows import kv_heads_per_rank


class Attention(nn.Module):
    """Fused q/k/v projection, rope, attention, o projection (row parallel) of one TP rank."""

    def __init__(self, config: ModelConfig, layer: int, qkv: Linear, o: RowParallelLinear, rotary: Rotary,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, *,
                 groups: StageGroups = StageGroups(), window: int | None = None, scale: float | None = None,
                 unit_offset_qk_norm: bool = False) -> None:
        """``qkv``: this rank's ``[q; k; v]`` rows, ``[(Hq + 2 * Hk) * D, hidden]`` with ``Hq`` and
        ``Hk`` the rank's query and KV heads; ``o``: its ``[hidden, Hq * D]`` block; ``groups``: the
        stage's rank groups (context parallel shards the cached sequence over ``groups.dcp`` and
        ``groups.pcp``); ``window``: the keys a query sees at most (None, or one reaching every
        position: all before it); ``scale``: the scores' (None: ``head_dim ** -0.5``);
        ``unit_offset_qk_norm``: the q/k norms scale by ``1 + w`` (Gemma's)."""
        super().__init__()
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"Attention: layer {layer} window must be an int >= 1 or None, got {window!r}")
        self.window = window if window is not None and window < config.max_position_embeddings else None
        if self.window is not None and groups.cp_size > 1:
            raise ValueError(f"Attention: layer {layer} has a sliding window of {self.window} tokens, which context "
                             f"parallel attention does not apply (cp_size={groups.cp_size}); run this model "
                             "without dcp/pcp")
        self.layer = layer
        tp_size = groups.tp.size
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = kv_heads_per_rank(config, tp_size)
        self.head_dim = config.head_dim
        rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if qkv.weight.shape[0] != rows:
            raise ValueError(f"Attention: layer {layer} qkv weight has {qkv.weight.shape[0]} rows, expected "
                             f"{rows} for {self.num_heads} query and {self.num_kv_heads} KV heads of {self.head_dim} "
                             f"(tp_size={tp_size})")
        self.scale = config.head_dim**-0.5 if scale is None else scale
        self.unit_offset_qk_norm = unit_offset_qk_norm
        self.qkv, self.o, self.rotary = qkv, o, rotary
        self.groups = groups
        if groups.cp_size > 1:
            check_groups(groups, config.num_kv_heads, tp_size, self.num_kv_heads)
        self.q_norm = None if q_norm is None else nn.Parameter(q_norm, requires_grad=False)
        self.k_norm = None if k_norm is None else nn.Parameter(k_norm, requires_grad=False)

    def forward(self, x: torch.Tensor, batch: StepBatch, meta: KVMetadata, kv: LayerKV) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; writes this layer's K/V into ``kv`` (each
        ``[num_blocks, block_size, Hk, D]``, with a compact cache's scales). Under prefill context
        parallelism ``x`` and ``batch`` are this rank's rows (``meta.pcp.batch``) and ``meta`` is built
        from the full step."""
        t, hq, hk, d = x.size(0), self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
        rows = None if batch.mrope_positions is None else self.rotary.rows(batch.mrope_positions)
        self.rotary(q, k, batch.positions, self.q_norm, self.k_norm, rows, unit_offset=self.unit_offset_qk_norm)
        if self.groups.cp_size > 1:
            return self.o(cp_attention(q, k, v, batch, meta, kv, self.scale, self.groups).view(t, hq * d))
        out = torch.empty((t, hq, d), dtype=x.dtype, device=x.device)
        scales = dict(k_scale=kv.k_scale, v_scale=kv.v_scale)
        compact = kv.k_scale is not None
        # The step's K/V go into the cache first; every prompt query reads them there, as stored,
        # whatever step, chunk or layout brought them. A decode row never reads its own slot but for
        # a compact cache's (see below).
        ops.reshape_and_cache(k, v, kv.k, kv.v, meta.slot_mapping, **scales)
        p, r = batch.num_prefill_tokens, batch.num_prefills
        if r and self.window is None:
            ops.extend_attention(q[:p], kv.k, kv.v, meta.block_tables[:r], meta.query_start_loc, meta.run_lens,
                                 self.scale, out=out[:p], **scales)
        elif r:
            self._window_prompts(q, k, v, batch, meta, kv, out)
        if p < t and compact:  # the new tokens are in the cache: each row reads its length and itself
            ops.decode_attention(q[p:], kv.k, kv.v, meta.block_tables[r:], meta.seq_lens[r:] + 1, self.scale,
                                 out=out[p:], window=self.window, **scales)
        elif p < t:
            ops.decode_attention(q[p:], kv.k, kv.v, meta.block_tables[r:], meta.seq_lens[r:], self.scale,
                                 k_new=k[p:], v_new=v[p:], out=out[p:], window=self.window)
        return self.o(out.view(t, hq * d))

    def _window_prompts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch,
                        meta: KVMetadata, kv: LayerKV, out: torch.Tensor) -> None:
        """A sliding-window layer's prompt rows into ``out``: its cache keeps only the positions a
        later query sees (a long chunk's first tokens are never stored), so each chunk attends by
        SDPA over its own K/V (as stored) and the cached tokens its window reaches."""
        if kv.k_scale is not None:
            k, v = as_stored(k, kv.k.dtype), as_stored(v, kv.v.dtype)
        for i, ((start, n), ctx) in enumerate(zip(batch.prefill_spans(), batch.context_lens)):
            # [1, H, n, D] views; enable_gqa lets the Hq / Hk query heads share a KV head.
            qs, ks, vs = (a[start : start + n].transpose(0, 1).unsqueeze(0) for a in (q, k, v))
            first = max(0, ctx - self.window + 1)  # the oldest key any query sees
            if first < ctx:  # a later chunk: the cached tokens it sees first, then the chunk
                cached = cached_tokens(kv, meta.block_tables[i], ctx, first)
                ks, vs = (torch.cat([c.to(a.dtype).transpose(0, 1).unsqueeze(0), a], 2) for c, a in zip(cached, (ks, vs)))
            mask = _mask(first, ctx, n, self.window, q.device) if ctx or n > self.window else None
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
            out[start : start + n] = o[0].transpose(0, 1)


def _mask(first: int, ctx: int, n: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[n, keys]`` bool: the keys at positions ``first .. ctx + n - 1`` that the chunk's queries at
    ``ctx .. ctx + n - 1`` see: ``q - window < k <= q`` (no lower bound without a window)."""
    keys = torch.arange(first, ctx + n, device=device)
    queries = torch.arange(ctx, ctx + n, device=device)[:, None]
    mask = keys <= queries
    return mask if window is None else mask & (keys > queries - window)


def cached_tokens(kv: LayerKV, block_table: torch.Tensor, n: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V at positions ``first .. n - 1`` a request holds in one layer's cache, in position
    order, from its ``block_table [max_blocks_per_seq]``: ``[n - first, Hk, D]`` each (a compact
    cache's dequantised to float32)."""
    block_size = kv.k.size(1)
    t = torch.arange(first, n, device=kv.k.device)
    blocks, offsets = block_table.long()[t // block_size], t % block_size
    if kv.k_scale is None:
        return kv.k[blocks, offsets], kv.v[blocks, offsets]
    return tuple(c[blocks, offsets].float() * s[blocks, offsets].float().unsqueeze(-1)
                 for c, s in ((kv.k, kv.k_scale), (kv.v, kv.v_scale)))

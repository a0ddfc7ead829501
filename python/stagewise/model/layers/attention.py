"""Self-attention over the paged KV cache: rotary, prefill by SDPA, decode by flash-decoding.

Prefill requests start from an empty cache, so each attends causally over its
own prompt with torch SDPA (GQA without repeating K/V). Decode requests attend
with :func:`stagewise.ops.decode_attention` over their cached tokens plus the new
token's k/v passed as ``k_new/v_new``. Then every token's K/V is written to the
cache with :func:`stagewise.ops.reshape_and_cache`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stagewise import ops
from stagewise.model.batch import KVMetadata, StepBatch
from stagewise.model.config import ModelConfig
from stagewise.model.layers import Linear, kv_head_shard, local_kv_heads, split
from stagewise.model.quant import cat_rows
from stagewise.model.rope import cos_sin_cache


class Rotary(nn.Module):
    """Rotary embedding of q and k in place, with Qwen3's per-head q/k RMSNorm fused in when given."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        # The table in the model's dtype rounds cos/sin as HF's ``cos.to(x.dtype)`` does.
        self.register_buffer("cos_sin_cache", cos_sin_cache(config, config.max_position_embeddings, dtype, device),
                             persistent=False)
        self.is_neox = config.rope.is_neox
        self.eps = config.norm_eps

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None) -> None:
        """``q [T, Hq, D]``, ``k [T, Hk, D]`` rotated in place; ``q_norm/k_norm [D]`` or None."""
        if q_norm is None:
            ops.rope(q, k, positions, self.cos_sin_cache, self.is_neox)
        else:
            ops.qk_norm_rope(q, k, q_norm, k_norm, positions, self.cos_sin_cache, self.eps, self.is_neox)


class Attention(nn.Module):
    """Fused q/k/v projection (column parallel), rope, attention, o projection (row parallel)."""

    def __init__(self, config: ModelConfig, layer: int, qkv: Linear, o: Linear, rotary: Rotary, tp_size: int,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None) -> None:
        super().__init__()
        if config.sliding_window is not None and config.sliding_window < config.max_position_embeddings:
            raise ValueError(f"Attention: sliding_window={config.sliding_window} is not supported "
                             f"(only full attention over max_position_embeddings={config.max_position_embeddings})")
        self.layer = layer
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = local_kv_heads(config.num_kv_heads, tp_size)
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv, self.o, self.rotary = qkv, o, rotary
        self.q_norm = None if q_norm is None else nn.Parameter(q_norm, requires_grad=False)
        self.k_norm = None if k_norm is None else nn.Parameter(k_norm, requires_grad=False)

    @classmethod
    def from_parts(cls, config: ModelConfig, layer: int, rotary: Rotary, tp_rank: int, tp_size: int, *,
                   q: tuple[torch.Tensor, torch.Tensor | None], k: tuple[torch.Tensor, torch.Tensor | None],
                   v: tuple[torch.Tensor, torch.Tensor | None], o: tuple[torch.Tensor, torch.Tensor | None],
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None) -> Attention:
        """From full (unsharded) ``(weight, bias)`` pairs: q ``[Hq*D, hidden]``, k/v ``[Hk*D, hidden]``,
        o ``[hidden, Hq*D]``. Query heads are split across ranks, KV heads split or replicated."""
        if config.num_heads % tp_size:
            raise ValueError(f"Attention: num_heads={config.num_heads} is not divisible by tp_size={tp_size}")
        hk = config.num_kv_heads
        weight = cat_rows([split(q[0], 0, tp_rank, tp_size, "num_heads"),
                           kv_head_shard(k[0], hk, tp_rank, tp_size), kv_head_shard(v[0], hk, tp_rank, tp_size)])
        bias = None
        if q[1] is not None:
            bias = torch.cat([split(q[1], 0, tp_rank, tp_size, "num_heads"),
                              kv_head_shard(k[1], hk, tp_rank, tp_size), kv_head_shard(v[1], hk, tp_rank, tp_size)])
        return cls(config, layer, Linear(weight, bias), Linear.row(o[0], o[1], tp_rank, tp_size), rotary, tp_size,
                   q_norm, k_norm)

    def forward(self, x: torch.Tensor, batch: StepBatch, meta: KVMetadata,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]`` (partial sums when tp_size > 1); writes this layer's K/V
        into ``kv = (k_cache, v_cache)``, each ``[num_blocks, block_size, Hk, D]``."""
        t, hq, hk, d = x.size(0), self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
        self.rotary(q, k, batch.positions, self.q_norm, self.k_norm)
        out = torch.empty((t, hq, d), dtype=x.dtype, device=x.device)
        for start, n in batch.prefill_spans():
            # [1, H, n, D] views; enable_gqa lets the Hq / Hk query heads share a KV head.
            qs, ks, vs = (a[start : start + n].transpose(0, 1).unsqueeze(0) for a in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=hq != hk)
            out[start : start + n] = o[0].transpose(0, 1)
        p, r = batch.num_prefill_tokens, batch.num_prefills
        if p < t:
            k_cache, v_cache = kv
            ops.decode_attention(q[p:], k_cache, v_cache, meta.block_tables[r:], meta.seq_lens[r:], self.scale,
                                 k_new=k[p:], v_new=v[p:], out=out[p:])
        ops.reshape_and_cache(k, v, kv[0], kv[1], meta.slot_mapping)
        return self.o(out.view(t, hq * d))

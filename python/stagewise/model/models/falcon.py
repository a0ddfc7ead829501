"""Falcon (rotary variants): LayerNorm, fused qkv, GELU MLP, attention and MLP in parallel.

transformers' FalconForCausalLM has three layouts of ``query_key_value [out, hidden]``, in blocks
of ``head_dim`` rows:
  new_decoder_architecture (40B/180B): per KV group ``[q_0 .. q_{g-1}, k, v]``, g = Hq / Hk;
  multi_query (7B): ``[q_0 .. q_{Hq-1}, k, v]``;
  neither (RW-1B style): per head ``[q_h, k_h, v_h]``.
A tensor-parallel rank's rows keep the layout with its own head counts (see
:mod:`stagewise.model.loader.sharding`); they are unpacked here into plain q, k, v so that one
attention serves all three. HF names, per layer ``transformer.h.{i}.``:
``self_attention.{query_key_value,dense}``, ``mlp.{dense_h_to_4h,dense_4h_to_h}``, norms
``input_layernorm`` (+ ``post_attention_layernorm`` when sequential) or ``ln_attn`` + ``ln_mlp``
(two norms in parallel).

Under tensor parallelism the sequential layout all-reduces after attention and after the MLP, as
Llama does. In the parallel layout attention and MLP read the same input and their outputs are
added, so their row-parallel partial sums are added first and reduced once: one all-reduce per
layer, and both biases (whole on every rank) added after it.
"""

from __future__ import annotations

import torch
from torch import nn

from stagewise.model.batch import KVMetadata, StepBatch
from stagewise.model.collectives import StageGroups
from stagewise.model.config import ModelConfig
from stagewise.model.layers.attention import Attention
from stagewise.model.layers.linear import AllReduce, Linear, RowParallelLinear, tp_all_reduce
from stagewise.model.layers.mlp import PlainMLP
from stagewise.model.layers.norm import LayerNorm
from stagewise.model.layers.rotary import Rotary
from stagewise.model.models.weights import Weights
from stagewise.model.shapes import final_norm_prefix, kv_heads_per_rank, layer_prefix


def _norm(config: ModelConfig, w: Weights, prefix: str) -> LayerNorm:
    return LayerNorm(w(prefix + "weight"), w(prefix + "bias"), config.norm_eps)


def final_norm(config: ModelConfig, w: Weights) -> LayerNorm:
    return _norm(config, w, final_norm_prefix(config))


def unpack_qkv(config: ModelConfig, fused: torch.Tensor, tp_size: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[Hq*D, ...]``, k and v ``[Hk*D, ...]`` out of one rank's fused weight ``[out, hidden]`` or
    bias ``[out]`` (``Hq``, ``Hk``: the rank's query and KV heads)."""
    hq, hk, d = config.num_heads // tp_size, kv_heads_per_rank(config, tp_size), config.head_dim
    rest = fused.shape[1:]
    if fused.shape[0] != (hq + 2 * hk) * d:
        raise ValueError(f"falcon: query_key_value has {fused.shape[0]} rows, expected {(hq + 2 * hk) * d} for "
                         f"{hq} query and {hk} KV heads of {d} (tp_size={tp_size})")
    if config.new_decoder_architecture:
        g = hq // hk
        x = fused.view(hk, g + 2, d, *rest)
        q, k, v = x[:, :g], x[:, g], x[:, g + 1]
    elif config.multi_query:
        x = fused.view(hq + 2, d, *rest)
        q, k, v = x[:hq], x[hq], x[hq + 1]
    else:
        x = fused.view(hq, 3, d, *rest)
        q, k, v = x[:, 0], x[:, 1], x[:, 2]
    return q.reshape(hq * d, *rest), k.reshape(hk * d, *rest), v.reshape(hk * d, *rest)


class FalconLayer(nn.Module):
    """Parallel: ``h + (mlp(ln_mlp(h)) + attn(ln_attn(h)))``; sequential: ``h += attn(ln(h)); h += mlp(ln2(h))``.

    Parallel: ``attn`` and ``mlp`` end in row-parallel linears without bias or reduction (partial
    sums); the layer reduces their sum with ``all_reduce`` (None: one rank) and adds ``bias``, the
    sum of their biases, once."""

    def __init__(self, attn: Attention, mlp: PlainMLP, ln_attn: LayerNorm, ln_mlp: LayerNorm | None,
                 parallel: bool, all_reduce: AllReduce | None = None, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.attn, self.mlp, self.ln_attn, self.ln_mlp, self.parallel = attn, mlp, ln_attn, ln_mlp, parallel
        self.all_reduce = all_reduce
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: StepBatch, meta: KVMetadata,
                kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, None]:
        a_in, h = self.ln_attn(x, residual)  # h: the whole hidden state
        if self.parallel:
            m_in = a_in if self.ln_mlp is None else self.ln_mlp(h)[0]
            attn = self.attn(a_in, batch, meta, kv)
            y = self.mlp(m_in) + attn
            if self.all_reduce is not None:
                y = self.all_reduce(y)
            return (y if self.bias is None else y + self.bias) + h, None
        h = self.attn(a_in, batch, meta, kv) + h
        return self.mlp(self.ln_mlp(h)[0]) + h, None


def _sum_biases(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or b is None:
        return a if b is None else b
    return a + b


def build_layer(config: ModelConfig, layer: int, w: Weights, rotary: Rotary,
                groups: StageGroups = StageGroups()) -> FalconLayer:
    """Decoder layer ``layer`` from this rank's weights (its shard for TP rank ``groups.tp.rank``)."""
    p = layer_prefix(config, layer)
    tp = groups.tp.size
    qkv_b = w.get(p + "self_attention.query_key_value.bias")
    qkv = Linear.fused(unpack_qkv(config, w(p + "self_attention.query_key_value.weight"), tp),
                       None if qkv_b is None else unpack_qkv(config, qkv_b, tp))
    dense_w, dense_b = w(p + "self_attention.dense.weight"), w.get(p + "self_attention.dense.bias")
    down_w, down_b = w(p + "mlp.dense_4h_to_h.weight"), w.get(p + "mlp.dense_4h_to_h.bias")
    reduce = tp_all_reduce(groups.tp)
    if config.parallel_attn:  # partial sums, reduced (and biased) once by the layer
        dense, down = RowParallelLinear(dense_w), RowParallelLinear(down_w)
    else:
        dense, down = RowParallelLinear(dense_w, dense_b, reduce), RowParallelLinear(down_w, down_b, reduce)
    attn = Attention(config, layer, qkv, dense, rotary, groups=groups)
    mlp = PlainMLP(Linear(w(p + "mlp.dense_h_to_4h.weight"), w.get(p + "mlp.dense_h_to_4h.bias")), down,
                   config.activation)
    if not config.parallel_attn:
        ln_attn, ln_mlp = _norm(config, w, p + "input_layernorm."), _norm(config, w, p + "post_attention_layernorm.")
        return FalconLayer(attn, mlp, ln_attn, ln_mlp, False)
    if config.num_ln_in_parallel_attn == 2:
        ln_attn, ln_mlp = _norm(config, w, p + "ln_attn."), _norm(config, w, p + "ln_mlp.")
    else:
        ln_attn, ln_mlp = _norm(config, w, p + "input_layernorm."), None
    return FalconLayer(attn, mlp, ln_attn, ln_mlp, True, reduce, _sum_biases(dense_b, down_b))

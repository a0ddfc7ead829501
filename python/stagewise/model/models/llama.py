"""Llama (and Mistral): pre-norm decoder layers of RMSNorm, GQA attention and a SwiGLU MLP.

The layer is also Qwen3's and Qwen3-MoE's; they change the attention (q/k norm)
or the MLP through the hooks of :func:`build_layer`. HF names, per layer
``model.layers.{i}.``: ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj`` (the prefix comes from the table,
:func:`stagewise.model.shapes.layer_prefix`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from stagewise.model.batch import KVMetadata, StepBatch
from stagewise.model.config import ModelConfig
from stagewise.model.layers.attention import Attention
from stagewise.model.collectives import StageGroups
from stagewise.model.layers.linear import Linear, RowParallelLinear, tp_all_reduce
from stagewise.model.layers.mlp import GatedMLP
from stagewise.model.layers.norm import RMSNorm
from stagewise.model.layers.rotary import Rotary
from stagewise.model.models.weights import Weights
from stagewise.model.shapes import final_norm_prefix, layer_prefix


class DecoderLayer(nn.Module):
    """``h += attn(norm(h)); h += mlp(norm(h))`` with the residual kept apart from the output.

    Each layer returns ``(x, residual)`` whose sum is the HF hidden state; the next
    layer's first norm adds them in one fused op (``residual`` None: nothing pending).
    """

    def __init__(self, input_norm: RMSNorm, attn: Attention, post_norm: RMSNorm, mlp: nn.Module) -> None:
        super().__init__()
        self.input_norm, self.attn, self.post_norm, self.mlp = input_norm, attn, post_norm, mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: StepBatch, meta: KVMetadata,
                kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_norm(x, residual)
        x = self.attn(x, batch, meta, kv)
        x, residual = self.post_norm(x, residual)
        return self.mlp(x), residual


def final_norm(config: ModelConfig, w: Weights) -> RMSNorm:
    return RMSNorm(w(final_norm_prefix(config) + "weight"), config.norm_eps)


def attention(config: ModelConfig, layer: int, w: Weights, rotary: Rotary, groups: StageGroups) -> Attention:
    """The ``self_attn`` block; with ``config.qk_norm`` also its ``q_norm``/``k_norm`` (Qwen3)."""
    p = layer_prefix(config, layer) + "self_attn."
    qkv = Linear.fused([w(f"{p}{n}_proj.weight") for n in "qkv"], [w.get(f"{p}{n}_proj.bias") for n in "qkv"])
    o = RowParallelLinear(w(p + "o_proj.weight"), w.get(p + "o_proj.bias"), tp_all_reduce(groups.tp))
    norms = {}
    if config.qk_norm:
        norms = {"q_norm": w(p + "q_norm.weight"), "k_norm": w(p + "k_norm.weight")}
    return Attention(config, layer, qkv, o, rotary, **norms, groups=groups)


def dense_mlp(config: ModelConfig, layer: int, w: Weights, groups: StageGroups) -> nn.Module:
    p = layer_prefix(config, layer) + "mlp."
    gate_up = Linear.fused([w(p + "gate_proj.weight"), w(p + "up_proj.weight")],
                           [w.get(p + "gate_proj.bias"), w.get(p + "up_proj.bias")])
    down = RowParallelLinear(w(p + "down_proj.weight"), w.get(p + "down_proj.bias"), tp_all_reduce(groups.tp))
    return GatedMLP(gate_up, down, config.activation)


MlpBuilder = Callable[[ModelConfig, int, Weights, StageGroups], nn.Module]


def build_layer(config: ModelConfig, layer: int, w: Weights, rotary: Rotary, groups: StageGroups = StageGroups(),
                mlp: MlpBuilder = dense_mlp) -> DecoderLayer:
    """Decoder layer ``layer`` from this rank's weights (its shard for TP rank ``groups.tp.rank``);
    o and down all-reduce their partial sums over ``groups.tp``: one all-reduce after attention,
    one after the MLP."""
    p = layer_prefix(config, layer)
    return DecoderLayer(
        RMSNorm(w(p + "input_layernorm.weight"), config.norm_eps),
        attention(config, layer, w, rotary, groups),
        RMSNorm(w(p + "post_attention_layernorm.weight"), config.norm_eps),
        mlp(config, layer, w, groups),
    )

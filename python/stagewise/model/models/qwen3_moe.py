"""Qwen3-MoE: Qwen3's layer with a sparse mixture-of-experts MLP on most layers.

Layer ``i`` is sparse when :meth:`ModelConfig.is_moe_layer` says so (every
``decoder_sparse_step``-th layer, except ``mlp_only_layers``); the others keep
Qwen3's dense MLP. The experts come in transformers 5's fused form,
``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``, whatever form the
checkpoint stores them in (the loader maps per-expert files onto it), with the router
``mlp.gate.weight [E, H]``.
"""

from __future__ import annotations

from torch import nn

from stagewise.model.collectives import StageGroups
from stagewise.model.config import ModelConfig
from stagewise.model.layers.linear import tp_all_reduce
from stagewise.model.layers.moe import SparseMoE
from stagewise.model.layers.rotary import Rotary
from stagewise.model.models import llama
from stagewise.model.models.weights import Weights
from stagewise.model.shapes import layer_prefix

final_norm = llama.final_norm


def mlp(config: ModelConfig, layer: int, w: Weights, groups: StageGroups) -> nn.Module:
    """Experts split like a dense MLP over ``groups.tp`` (each its block of the intermediate dim;
    the router whole): one all-reduce after the weighted sum of the experts."""
    if not config.is_moe_layer(layer):
        return llama.dense_mlp(config, layer, w, groups)
    p = layer_prefix(config, layer) + "mlp."
    return SparseMoE(w.dense(p + "gate.weight"), w.dense(p + "experts.gate_up_proj"),
                     w.dense(p + "experts.down_proj"), config.num_experts_per_tok, config.norm_topk_prob,
                     config.activation, tp_all_reduce(groups.tp))


def build_layer(config: ModelConfig, layer: int, w: Weights, rotary: Rotary,
                groups: StageGroups = StageGroups()) -> llama.DecoderLayer:
    return llama.build_layer(config, layer, w, rotary, groups, mlp=mlp)

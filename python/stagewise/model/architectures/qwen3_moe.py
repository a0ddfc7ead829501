"""Qwen3-MoE (and Qwen3-VL-MoE's text model): Qwen3's layer with a sparse mixture-of-experts MLP on
most layers.

Layer ``i`` is sparse when :meth:`ModelConfig.is_moe_layer` says so (every
``decoder_sparse_step``-th layer, except ``mlp_only_layers``); the others keep Qwen3's dense MLP.
The experts come in transformers 5's fused form, ``mlp.experts.gate_up_proj [E, 2I, H]`` and
``mlp.experts.down_proj [E, H, I]``, whatever form the checkpoint stores them in (the loader maps
per-expert files onto it), with the router ``mlp.gate.weight [E, H]``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from stagewise.model.architectures import llama, qwen3
from stagewise.model.architectures.base import Architecture, HFKeys, LayerWork, StageBuild
from stagewise.model.collectives import StageGroups
from stagewise.model.config import ModelConfig, MoEConfig
from stagewise.model.layers.decoder import DecoderLayer
from stagewise.model.layers.linear import tp_all_reduce
from stagewise.model.layers.moe import SparseMoE
from stagewise.model.rows import TensorShape
from stagewise.model.weights import Weights

ROUTER, GATE_UP, DOWN = "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def _parse(hf: HFKeys) -> dict[str, Any]:
    moe = MoEConfig(
        num_experts=hf.get("num_experts", hf.get("num_local_experts", 0)),
        num_experts_per_tok=hf.get("num_experts_per_tok"),
        intermediate_size=hf.get("moe_intermediate_size"),
        # Qwen3-VL-MoE's router always renormalises its top-k weights: transformers' class has no
        # such field, and a file saved by it names none.
        norm_topk_prob=hf.model_type == "qwen3_vl_moe" or bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(hf.get("mlp_only_layers", ())),
    )
    return {**qwen3.fields(hf), "moe": moe}


def layer_tensors(config: ModelConfig, layer: int, p: str) -> list[TensorShape]:
    t = llama.attention_tensors(config, layer, p)
    if not config.is_moe_layer(layer):
        return t + llama.dense_mlp_tensors(config, layer, p)
    h, e, mi = config.hidden_size, config.moe.num_experts, config.moe.intermediate_size
    return t + [TensorShape(p + ROUTER, (e, h), "layer", layer=layer, kind="router"),
                TensorShape(p + GATE_UP, (e, 2 * mi, h), "layer", "expert_column", layer, kind="expert"),
                TensorShape(p + DOWN, (e, h, mi), "layer", "expert_row", layer, kind="expert")]


def mlp(config: ModelConfig, layer: int, p: str, w: Weights, groups: StageGroups) -> nn.Module:
    """Experts split like a dense MLP over ``groups.tp`` (each its block of the intermediate dim;
    the router whole): one all-reduce after the weighted sum of the experts."""
    if not config.is_moe_layer(layer):
        return llama.dense_mlp(config, layer, p, w, groups)
    return SparseMoE(w.dense(p + ROUTER), w.dense(p + GATE_UP), w.dense(p + DOWN), config.moe.num_experts_per_tok,
                     config.moe.norm_topk_prob, config.activation, tp_all_reduce(groups.tp))


def build_layer(config: ModelConfig, layer: int, p: str, w: Weights, stage: StageBuild) -> DecoderLayer:
    return llama.build_layer(config, layer, p, w, stage, mlp=mlp)


def _work(config: ModelConfig, layer: int) -> LayerWork:
    return LayerWork("experts" if config.is_moe_layer(layer) else "gated")


ARCHITECTURE = Architecture(
    name="qwen3_moe",
    hf_defaults={"qwen3_moe": dict(max_position_embeddings=32768),
                 "qwen3_vl_moe": dict(max_position_embeddings=128000, rope_theta=500000.0,
                                      mrope_section=qwen3.MROPE_SECTION)},
    multimodal=frozenset({"qwen3_vl_moe"}), multimodal_prefix=qwen3.VL_PREFIX,
    parse=_parse,
    layer_tensors=layer_tensors, final_norm_tensors=llama.final_norm_tensors,
    build_layer=build_layer, build_final_norm=llama.build_final_norm,
    layer_work=_work,
    decode_stack="its sparse layers route each token to a few experts; the C++ loop runs dense gated MLPs only",
)

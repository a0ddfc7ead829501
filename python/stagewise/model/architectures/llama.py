"""Llama (and Mistral, Llama with an attention window): pre-norm decoder layers of RMSNorm, GQA
attention and a SwiGLU MLP.

Its pieces are the Llama family's, which Qwen2, Qwen3 and Qwen3-MoE build on: the config keys
(:func:`fields`), the rows of a layer (:func:`attention_tensors`, :func:`dense_mlp_tensors`), the
layer's wiring (:func:`build_layer`, with the MLP as a parameter), and llama.cpp's names
(:data:`GGUF_LAYER_NAMES`). HF names, per layer ``model.layers.{i}.``: ``input_layernorm``,
``self_attn.{q,k,v,o}_proj`` (+ ``self_attn.{q,k}_norm`` with q/k norms),
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``; each is written once, below, for the
table and the wiring alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from stagewise.model.architectures.base import Architecture, GGUFNames, HFKeys, LayerWork, StageBuild
from stagewise.model.collectives import StageGroups
from stagewise.model.config import ModelConfig
from stagewise.model.layers.attention import Attention
from stagewise.model.layers.decoder import DecoderLayer
from stagewise.model.layers.linear import Linear, RowParallelLinear, tp_all_reduce
from stagewise.model.layers.mlp import GatedMLP
from stagewise.model.layers.norm import RMSNorm
from stagewise.model.layers.rotary import Rotary
from stagewise.model.rows import TensorShape, linear_rows, norm_rows
from stagewise.model.weights import Weights

INPUT_NORM, POST_NORM = "input_layernorm", "post_attention_layernorm"
ATTN, QKV, O, QK_NORMS = "self_attn.", ("q_proj", "k_proj", "v_proj"), "o_proj", ("q_norm", "k_norm")
MLP, GATE_UP, DOWN = "mlp.", ("gate_proj", "up_proj"), "down_proj"

GGUF_LAYER_NAMES = {
    "attn_norm.weight": f"{INPUT_NORM}.weight", "ffn_norm.weight": f"{POST_NORM}.weight",
    **{f"attn_{x}.{kind}": f"{ATTN}{proj}.{kind}" for x, proj in zip("qkv", QKV) for kind in ("weight", "bias")},
    "attn_output.weight": f"{ATTN}{O}.weight",
    "attn_q_norm.weight": f"{ATTN}{QK_NORMS[0]}.weight", "attn_k_norm.weight": f"{ATTN}{QK_NORMS[1]}.weight",
    "ffn_gate.weight": f"{MLP}{GATE_UP[0]}.weight", "ffn_up.weight": f"{MLP}{GATE_UP[1]}.weight",
    "ffn_down.weight": f"{MLP}{DOWN}.weight",
}
"""llama.cpp's names inside a block of the Llama family -> HF's inside a layer."""


# ---- config.json ----------------------------------------------------------------------------------

def fields(hf: HFKeys, *, qkv_bias: bool, o_bias: bool, mlp_bias: bool = False, qk_norm: bool = False,
           sliding_window: int | None = None) -> dict[str, Any]:
    """The Llama family's ModelConfig fields from its keys (transformers' names), with the parts
    each member fixes or reads its own way given."""
    return dict(
        num_kv_heads=hf.get("num_key_value_heads", hf.get("num_attention_heads")),
        head_dim=hf.head_dim(),
        intermediate_size=hf.get("intermediate_size"),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation=hf.get("hidden_act", "silu"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, qk_norm=qk_norm, sliding_window=sliding_window,
    )


def _parse(hf: HFKeys) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))  # q, k, v and o alike
    return fields(hf, qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)),
                  sliding_window=hf.get("sliding_window", None))


# ---- the table's rows -----------------------------------------------------------------------------

def attention_tensors(config: ModelConfig, layer: int, p: str) -> list[TensorShape]:
    """The layer's two norms and its attention: q, k, v, o (+ biases), and q/k norms when it has them."""
    h, d, hq, hk = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
    t = norm_rows(p + INPUT_NORM, h, "layer", layer, False) + norm_rows(p + POST_NORM, h, "layer", layer, False)
    for proj, rows, split in zip(QKV, (hq * d, hk * d, hk * d), ("column", "kv_column", "kv_column")):
        t += linear_rows(p + ATTN + proj, rows, h, split, layer, config.qkv_bias)
    t += linear_rows(p + ATTN + O, h, hq * d, "row", layer, config.o_bias)
    if config.qk_norm:
        t += [TensorShape(f"{p}{ATTN}{n}.weight", (d,), "layer", layer=layer, kind="norm") for n in QK_NORMS]
    return t


def dense_mlp_tensors(config: ModelConfig, layer: int, p: str) -> list[TensorShape]:
    h, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
    t = [row for proj in GATE_UP for row in linear_rows(p + MLP + proj, inter, h, "column", layer, bias)]
    return t + linear_rows(p + MLP + DOWN, h, inter, "row", layer, bias)


def layer_tensors(config: ModelConfig, layer: int, p: str) -> list[TensorShape]:
    return attention_tensors(config, layer, p) + dense_mlp_tensors(config, layer, p)


def final_norm_tensors(config: ModelConfig, name: str) -> list[TensorShape]:
    return norm_rows(name, config.hidden_size, "final_norm", None, False)


# ---- wiring ---------------------------------------------------------------------------------------

def attention(config: ModelConfig, layer: int, p: str, w: Weights, stage: StageBuild, rotary: Rotary | None = None,
              **options: Any) -> Attention:
    """The ``self_attn`` block; with ``config.qk_norm`` also its ``q_norm``/``k_norm`` (Qwen3). It
    rotates with ``rotary`` (None: the stage's table) and attends over ``config.sliding_window``
    (Mistral's); ``options``: :class:`Attention`'s keywords (``window``, ``scale``, ...) that differ."""
    groups = stage.groups
    a = p + ATTN
    qkv = Linear.fused([w(f"{a}{n}.weight") for n in QKV], [w.get(f"{a}{n}.bias") for n in QKV])
    o = RowParallelLinear(w(f"{a}{O}.weight"), w.get(f"{a}{O}.bias"), tp_all_reduce(groups.tp))
    norms = {}
    if config.qk_norm:
        norms = {n: w(f"{a}{n}.weight") for n in QK_NORMS}
    options = {"window": config.sliding_window, **options}
    return Attention(config, layer, qkv, o, stage.rotary if rotary is None else rotary, **norms, groups=groups,
                     **options)


def dense_mlp(config: ModelConfig, layer: int, p: str, w: Weights, groups: StageGroups) -> nn.Module:
    m = p + MLP
    gate_up = Linear.fused([w(f"{m}{n}.weight") for n in GATE_UP], [w.get(f"{m}{n}.bias") for n in GATE_UP])
    down = RowParallelLinear(w(f"{m}{DOWN}.weight"), w.get(f"{m}{DOWN}.bias"), tp_all_reduce(groups.tp))
    return GatedMLP(gate_up, down, config.activation)


MlpBuilder = Callable[[ModelConfig, int, str, Weights, StageGroups], nn.Module]


def build_layer(config: ModelConfig, layer: int, p: str, w: Weights, stage: StageBuild,
                mlp: MlpBuilder = dense_mlp) -> DecoderLayer:
    """Decoder layer ``layer`` from this rank's weights (its shard for TP rank ``stage.groups.tp.rank``);
    o and down all-reduce their partial sums over ``stage.groups.tp``: one all-reduce after
    attention, one after the MLP."""
    return DecoderLayer(
        RMSNorm(w(f"{p}{INPUT_NORM}.weight"), config.norm_eps),
        attention(config, layer, p, w, stage),
        RMSNorm(w(f"{p}{POST_NORM}.weight"), config.norm_eps),
        mlp(config, layer, p, w, stage.groups),
    )


def build_final_norm(config: ModelConfig, name: str, w: Weights) -> RMSNorm:
    return RMSNorm(w(name + ".weight"), config.norm_eps)


def gated_work(config: ModelConfig, layer: int) -> LayerWork:
    return LayerWork("gated", config.sliding_window)


ARCHITECTURE = Architecture(
    name="llama",
    hf_defaults={"llama": dict(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
                 "mistral": dict(max_position_embeddings=131072, sliding_window=4096, bos_token_id=1, eos_token_id=2)},
    parse=_parse,
    layer_tensors=layer_tensors, final_norm_tensors=final_norm_tensors,
    build_layer=build_layer, build_final_norm=build_final_norm,
    layer_work=gated_work,
    decode_stack=None,
    gguf=GGUFNames(architectures=("llama",), model_type="llama", layer_tensors=GGUF_LAYER_NAMES, permuted_qk=True),
)

"""Gemma 3 (text): a norm before and after each of attention and the MLP, norms that scale by
``1 + w``, per-head q/k norms, a tanh-GELU gated MLP, embeddings scaled by ``sqrt(hidden)``, and
two kinds of layer: sliding layers (``layer_types``: ``sliding_attention``) attend over the last
``sliding_window`` keys with a rope of their own base, full layers over every key with the rope
of ``rope_theta`` (and its scaling).

HF names, per layer ``model.layers.{i}.``: Llama's (``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``self_attn.{q,k}_norm``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``) and
``pre_feedforward_layernorm``, ``post_feedforward_layernorm``; the embedding is tied. Scores are
scaled by ``query_pre_attn_scalar ** -0.5``. A config gives the layer kinds as ``layer_types`` or
as ``sliding_window_pattern`` (every such layer but the last of each run slides), and the two ropes
as transformers 5's ``rope_parameters`` per layer type or as ``rope_theta`` (+ ``rope_scaling``)
and ``rope_local_base_freq``. Logit soft-capping (Gemma 2's) is refused by name.

llama.cpp stores it as ``gemma3``: its converter adds 1 to every norm weight (taken off here) and
writes neither the layer pattern (llama.cpp fixes transformers' default, 6, as the defaults here
do) nor ``query_pre_attn_scalar``, which llama.cpp takes as ``head_dim`` for every Gemma 3 but the
27B (``hidden / heads`` there, told apart by its 62 layers): a file is read as llama.cpp reads it
but for that one model. The multimodal ``gemma3`` model type (a vision tower beside this text
model) is not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stagewise.model.architectures import llama
from stagewise.model.architectures.base import (Architecture, GGUFNames, HFKeys, LayerWork, StageBuild,
                                                own_fields)
from stagewise.model.config import ModelConfig, RopeConfig
from stagewise.model.layers.decoder import SandwichDecoderLayer
from stagewise.model.layers.norm import RMSNorm
from stagewise.model.layers.rotary import Rotary
from stagewise.model.rows import TensorShape, norm_rows
from stagewise.model.weights import Weights

SLIDING, FULL = "sliding_attention", "full_attention"
PRE_MLP_NORM, POST_MLP_NORM = "pre_feedforward_layernorm", "post_feedforward_layernorm"
SOFTCAPS = ("final_logit_softcapping", "attn_logit_softcapping")

GGUF_LAYER_NAMES = {
    **llama.GGUF_LAYER_NAMES,
    "post_attention_norm.weight": f"{llama.POST_NORM}.weight",
    "ffn_norm.weight": f"{PRE_MLP_NORM}.weight",
    "post_ffw_norm.weight": f"{POST_MLP_NORM}.weight",
}
"""llama.cpp's names inside a block -> HF's: Llama's, with ``ffn_norm`` the norm before the MLP."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemma3Fields:
    """Gemma 3's own fields (``ModelConfig.arch``)."""

    sliding_layers: tuple[int, ...]
    """The layers that attend over ``ModelConfig.sliding_window`` keys (with ``local_rope``)."""
    local_rope: RopeConfig
    """The sliding layers' rope; the full layers' is ``ModelConfig.rope``."""
    query_pre_attn_scalar: float
    """Scores are scaled by its inverse square root."""

    def __post_init__(self) -> None:
        if not self.query_pre_attn_scalar > 0:
            raise ValueError(f"Gemma3Fields.query_pre_attn_scalar: expected a positive number, got "
                             f"{self.query_pre_attn_scalar!r}")


def fields(config: ModelConfig) -> Gemma3Fields:
    return own_fields(config, Gemma3Fields)


def window(config: ModelConfig, layer: int) -> int | None:
    """The keys layer ``layer`` attends to at most (None: every one before the query)."""
    return config.sliding_window if layer in fields(config).sliding_layers else None


# ---- config.json ----------------------------------------------------------------------------------

def _layer_types(hf: HFKeys) -> list[str]:
    """``layer_types``, or the kinds ``sliding_window_pattern`` gives (transformers' rule)."""
    n = hf.get("num_hidden_layers")
    types = hf.get("layer_types", None)
    if types is None:
        pattern = hf.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"config.json: field 'sliding_window_pattern' must be an int >= 1, got {pattern!r}")
        return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"config.json: field 'layer_types' must list {SLIDING!r} or {FULL!r} for each of the "
                         f"{n} layers, got {types!r}")
    return types


def _ropes(hf: HFKeys) -> tuple[RopeConfig, RopeConfig]:
    """(the full layers' rope, the sliding layers')."""
    local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq")}
    params = hf.keys.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        unknown = sorted(set(params) - {SLIDING, FULL})
        if unknown:
            raise ValueError(f"config.json: field 'rope_parameters' has {unknown}; expected the layer types "
                             f"{SLIDING!r} and {FULL!r}")
        full = {"rope_theta": hf.get("rope_theta"), **(params.get(FULL) or {})}
        return hf.rope(full), hf.rope({**local, **(params.get(SLIDING) or {})})
    return hf.rope(), hf.rope(local)


def _parse(hf: HFKeys) -> dict[str, Any]:
    for key in SOFTCAPS:
        if hf.get(key, None) is not None:
            raise ValueError(f"config.json: {key}={hf.get(key)} is not supported (Gemma 3 has no soft-capping)")
    if hf.get("use_bidirectional_attention", False):
        raise ValueError("config.json: use_bidirectional_attention=True is not supported (a decoder attends causally)")
    types = _layer_types(hf)
    sliding = tuple(i for i, kind in enumerate(types) if kind == SLIDING)
    window_size = hf.get("sliding_window", None)
    if sliding and window_size is None:
        raise ValueError(f"config.json: field 'sliding_window' is required: layers {list(sliding)} are "
                         f"{SLIDING!r}")
    full, local = _ropes(hf)
    bias = bool(hf.get("attention_bias", False))
    return dict(
        num_kv_heads=hf.get("num_key_value_heads"),
        head_dim=hf.head_dim(),
        intermediate_size=hf.get("intermediate_size"),
        norm_eps=hf.get("rms_norm_eps"),
        activation=hf.get("hidden_activation"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings")),
        qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=window_size if sliding else None, rope=full,
        arch=Gemma3Fields(sliding_layers=sliding, local_rope=local,
                          query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar"))),
    )


# ---- the table's rows -----------------------------------------------------------------------------

def layer_tensors(config: ModelConfig, layer: int, p: str) -> list[TensorShape]:
    h = config.hidden_size
    norms = norm_rows(p + PRE_MLP_NORM, h, "layer", layer, False) + norm_rows(p + POST_MLP_NORM, h, "layer", layer,
                                                                              False)
    return llama.attention_tensors(config, layer, p) + norms + llama.dense_mlp_tensors(config, layer, p)


# ---- wiring ---------------------------------------------------------------------------------------

def _norm(config: ModelConfig, w: Weights, name: str) -> RMSNorm:
    return RMSNorm(w(name + ".weight"), config.norm_eps, unit_offset=True)


def build_layer(config: ModelConfig, layer: int, p: str, w: Weights, stage: StageBuild) -> SandwichDecoderLayer:
    """Decoder layer ``layer``: a sliding one rotates with the stage's second rope table (made once,
    for its first sliding layer)."""
    own, size = fields(config), window(config, layer)
    rotary = None
    if size is not None:
        rotary = stage.share("local_rotary", lambda: Rotary(config.replace(rope=own.local_rope), stage.dtype,
                                                            stage.device))
    attn = llama.attention(config, layer, p, w, stage, rotary, window=size,
                           scale=own.query_pre_attn_scalar**-0.5, unit_offset_qk_norm=True)
    return SandwichDecoderLayer(
        _norm(config, w, p + llama.INPUT_NORM), attn, _norm(config, w, p + llama.POST_NORM),
        _norm(config, w, p + PRE_MLP_NORM), llama.dense_mlp(config, layer, p, w, stage.groups),
        _norm(config, w, p + POST_MLP_NORM),
    )


def build_final_norm(config: ModelConfig, name: str, w: Weights) -> RMSNorm:
    return _norm(config, w, name)


def _from_gguf(name: str, values: Any) -> Any:
    """llama.cpp's converter stores every norm weight plus 1."""
    return values - 1 if name.endswith("norm.weight") else values


ARCHITECTURE = Architecture(
    name="gemma3",
    hf_defaults={"gemma3_text": dict(
        max_position_embeddings=131072, head_dim=256, num_key_value_heads=4, hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e6, rope_local_base_freq=1e4,
        query_pre_attn_scalar=256, sliding_window=4096, bos_token_id=2, eos_token_id=1)},
    parse=_parse,
    own_fields=Gemma3Fields,
    layer_tensors=layer_tensors, final_norm_tensors=llama.final_norm_tensors,
    build_layer=build_layer, build_final_norm=build_final_norm,
    embedding_scale=lambda config: config.hidden_size**0.5,
    layer_work=lambda config, layer: LayerWork("gated", window(config, layer), post_norms=True),
    decode_stack="its layers norm the outputs of attention and the MLP too, with Gemma's (1 + w) norms, and its "
                 "sliding layers attend over a window with a rope table of their own",
    gguf=GGUFNames(architectures=("gemma3",), model_type="gemma3_text", layer_tensors=GGUF_LAYER_NAMES,
                   metadata={"attention.sliding_window": "sliding_window", "rope.freq_base_swa": "rope_local_base_freq",
                             "attention.key_length": "query_pre_attn_scalar"},
                   adjust=_from_gguf),
)

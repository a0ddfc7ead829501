"""Qwen3 (and Qwen3-VL's text model): Llama's decoder layer with a per-head RMSNorm of q and k
before rope.

HF names are Llama's plus ``self_attn.{q,k}_norm.weight`` ``[head_dim]``; the norm and the rotation
run as one op (:func:`stagewise.ops.qk_norm_rope`). A Qwen3-VL checkpoint (model type
``qwen3_vl``) keeps this text model under ``model.language_model.`` beside its vision tower.
"""

from __future__ import annotations

from typing import Any

from stagewise.model.architectures import llama
from stagewise.model.architectures.base import Architecture, GGUFNames, HFKeys

MROPE_SECTION = (24, 20, 20)  # transformers' Qwen3-VL rotary embedding when the file names none
VL_PREFIX = "model.language_model."


def fields(hf: HFKeys) -> dict[str, Any]:
    """Qwen3's and Qwen3-MoE's attention: q/k norms; q, k, v and o biased alike; no window."""
    if hf.get("use_sliding_window", False):
        raise ValueError(f"config.json: use_sliding_window=True is not supported for {hf.model_type} models")
    bias = bool(hf.get("attention_bias", False))
    return llama.fields(hf, qkv_bias=bias, o_bias=bias, qk_norm=True)


ARCHITECTURE = Architecture(
    name="qwen3",
    hf_defaults={"qwen3": dict(max_position_embeddings=32768, head_dim=128),
                 "qwen3_vl": dict(max_position_embeddings=128000, head_dim=128, rope_theta=500000.0,
                                  mrope_section=MROPE_SECTION)},
    multimodal=frozenset({"qwen3_vl"}), multimodal_prefix=VL_PREFIX,
    parse=fields,
    layer_tensors=llama.layer_tensors, final_norm_tensors=llama.final_norm_tensors,
    build_layer=llama.build_layer, build_final_norm=llama.build_final_norm,
    layer_work=llama.gated_work,
    decode_stack=None,
    gguf=GGUFNames(architectures=("qwen3",), model_type="qwen3", layer_tensors=llama.GGUF_LAYER_NAMES),
)

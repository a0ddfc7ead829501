"""Qwen3: Llama's decoder layer with a per-head RMSNorm of q and k before rope.

HF names are Llama's plus ``model.layers.{i}.self_attn.{q,k}_norm.weight`` ``[head_dim]``;
the norm and the rotation run as one op (:func:`stagewise.ops.qk_norm_rope`).
"""

from __future__ import annotations

from stagewise.model.collectives import StageGroups
from stagewise.model.config import ModelConfig
from stagewise.model.layers.rotary import Rotary
from stagewise.model.models import llama
from stagewise.model.models.weights import Weights

final_norm = llama.final_norm


def build_layer(config: ModelConfig, layer: int, w: Weights, rotary: Rotary,
                groups: StageGroups = StageGroups()) -> llama.DecoderLayer:
    if not config.qk_norm:
        raise ValueError(f"qwen3.build_layer: config.qk_norm must be True for Qwen3, got {config.qk_norm}")
    return llama.build_layer(config, layer, w, rotary, groups)

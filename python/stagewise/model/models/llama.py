"""Llama (and Mistral): pre-norm decoder layers of RMSNorm, GQA attention and a SwiGLU MLP.

The layer is also Qwen3's and Qwen3-MoE's; they change the attention (q/k norm)
or the MLP through the hooks of :func:`build_layer`. HF names, per layer
``model.layers.{i}.``: ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from stagewise.model.attention import Attention, Rotary
from stagewise.model.batch import KVMetadata, StepBatch
from stagewise.model.config import ModelConfig
from stagewise.model.layers import GatedMLP, RMSNorm, Weights

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm."
LM_HEAD = "lm_head.weight"


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


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
    return RMSNorm(w(FINAL_NORM + "weight"), config.norm_eps)


def attention(config: ModelConfig, layer: int, w: Weights, rotary: Rotary, tp_rank: int, tp_size: int) -> Attention:
    """The ``self_attn`` block; with ``config.qk_norm`` also its ``q_norm``/``k_norm`` (Qwen3)."""
    p = layer_prefix(layer) + "self_attn."
    parts = {n: (w(f"{p}{n}_proj.weight"), w.get(f"{p}{n}_proj.bias")) for n in "qkvo"}
    norms = {}
    if config.qk_norm:
        norms = {"q_norm": w(f"{p}q_norm.weight"), "k_norm": w(f"{p}k_norm.weight")}
    return Attention.from_parts(config, layer, rotary, tp_rank, tp_size, **parts, **norms)


def dense_mlp(config: ModelConfig, layer: int, w: Weights, tp_rank: int, tp_size: int) -> nn.Module:
    return GatedMLP.from_weights(w, layer_prefix(layer) + "mlp.", config.activation, tp_rank, tp_size)


MlpBuilder = Callable[[ModelConfig, int, Weights, int, int], nn.Module]


def build_layer(config: ModelConfig, layer: int, w: Weights, rotary: Rotary, tp_rank: int, tp_size: int,
                mlp: MlpBuilder = dense_mlp) -> DecoderLayer:
    p = layer_prefix(layer)
    return DecoderLayer(
        RMSNorm(w(p + "input_layernorm.weight"), config.norm_eps),
        attention(config, layer, w, rotary, tp_rank, tp_size),
        RMSNorm(w(p + "post_attention_layernorm.weight"), config.norm_eps),
        mlp(config, layer, w, tp_rank, tp_size),
    )

"""The pre-norm decoder layer (Llama's, Qwen2's, Qwen3's, Qwen3-MoE's): ``h += attn(norm(h));
h += mlp(norm(h))``, with the residual kept apart from the output. The C++ layer loop
(:mod:`stagewise.model.decode_stack`) runs these layers when their MLP is a dense gated one.
:class:`SandwichDecoderLayer` (Gemma's) also normalises the outputs of attention and the MLP."""

from __future__ import annotations

import torch
from torch import nn

from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata
from stagewise.model.layers.attention import Attention
from stagewise.model.layers.norm import RMSNorm


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


class SandwichDecoderLayer(nn.Module):
    """Gemma's layer: a norm before and after each of attention and the MLP,
    ``h += post_attn_norm(attn(input_norm(h))); h += post_mlp_norm(mlp(pre_mlp_norm(h)))``.

    It returns ``(x, residual)`` as :class:`DecoderLayer` does: the post-norms' outputs are added
    to the residual by the next norm's fused add (the next layer's, or the final norm)."""

    def __init__(self, input_norm: RMSNorm, attn: Attention, post_attn_norm: RMSNorm, pre_mlp_norm: RMSNorm,
                 mlp: nn.Module, post_mlp_norm: RMSNorm) -> None:
        super().__init__()
        self.input_norm, self.attn, self.post_attn_norm = input_norm, attn, post_attn_norm
        self.pre_mlp_norm, self.mlp, self.post_mlp_norm = pre_mlp_norm, mlp, post_mlp_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: StepBatch, meta: KVMetadata,
                kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_norm(x, residual)
        x, _ = self.post_attn_norm(self.attn(x, batch, meta, kv))
        x, residual = self.pre_mlp_norm(x, residual)
        x, _ = self.post_mlp_norm(self.mlp(x))
        return x, residual

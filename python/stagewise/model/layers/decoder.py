"""The pre-norm decoder layer (Llama's, Qwen2's, Qwen3's, Qwen3-MoE's): ``h += attn(norm(h));
h += mlp(norm(h))``, with the residual kept apart from the output. The C++ layer loop
(:mod:`stagewise.model.decode_stack`) runs these layers when their MLP is a dense gated one."""

from __future__ import annotations

import torch
from torch import nn

from stagewise.model.batch import KVMetadata, StepBatch
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

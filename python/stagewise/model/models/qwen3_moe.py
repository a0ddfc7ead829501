"""Qwen3-MoE: Qwen3's layer with a sparse mixture-of-experts MLP on most layers.

Layer ``i`` is sparse when :meth:`ModelConfig.is_moe_layer` says so (every
``decoder_sparse_step``-th layer, except ``mlp_only_layers``); the others keep
Qwen3's dense MLP. Router: softmax over the experts in float32, top-k,
renormalised when ``norm_topk_prob``. Expert weights are read in either HF form:
checkpoint files (``mlp.experts.{e}.{gate,up,down}_proj.weight``) or transformers 5
modules (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stagewise.model import llama
from stagewise.model.attention import Rotary
from stagewise.model.config import ModelConfig
from stagewise.model.layers import Weights, activation, split

EMBED, FINAL_NORM, LM_HEAD = llama.EMBED, llama.FINAL_NORM, llama.LM_HEAD
final_norm = llama.final_norm


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts; each rank holds every expert's ``1 / tp`` of the intermediate dim."""

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                 norm_topk_prob: bool, act: str) -> None:
        super().__init__()
        self.router = nn.Parameter(router, requires_grad=False)  # [E, hidden]
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)  # [E, 2 * I_local, hidden]
        self.down = nn.Parameter(down, requires_grad=False)  # [E, hidden, I_local]
        self.top_k, self.norm_topk_prob, self.act = top_k, norm_topk_prob, activation(act)

    @classmethod
    def from_weights(cls, config: ModelConfig, w: Weights, prefix: str, tp_rank: int, tp_size: int) -> SparseMoE:
        e, inter = config.num_experts, config.moe_intermediate_size
        if f"{prefix}experts.gate_up_proj" in w:
            gate, up = w(f"{prefix}experts.gate_up_proj").split(inter, dim=1)
            down = w(f"{prefix}experts.down_proj")
        else:
            def stack(name: str) -> torch.Tensor:
                return torch.stack([w.dense(f"{prefix}experts.{i}.{name}.weight") for i in range(e)])
            gate, up, down = stack("gate_proj"), stack("up_proj"), stack("down_proj")
        gate_up = torch.cat([split(gate, 1, tp_rank, tp_size, "moe_intermediate_size"),
                             split(up, 1, tp_rank, tp_size, "moe_intermediate_size")], dim=1)
        return cls(w.dense(f"{prefix}gate.weight"), gate_up, split(down, 2, tp_rank, tp_size, "moe_intermediate_size"),
                   config.num_experts_per_tok, config.norm_topk_prob, config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]`` (partial sums when tp_size > 1)."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        # One pass per expert over the tokens routed to it (in expert order, as HF sums them).
        for e in torch.unique(experts).tolist():
            tokens, slot = torch.where(experts == e)
            gate, up = F.linear(x[tokens], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down[e]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y)
        return out


def mlp(config: ModelConfig, layer: int, w: Weights, tp_rank: int, tp_size: int) -> nn.Module:
    if config.is_moe_layer(layer):
        return SparseMoE.from_weights(config, w, llama.layer_prefix(layer) + "mlp.", tp_rank, tp_size)
    return llama.dense_mlp(config, layer, w, tp_rank, tp_size)


def build_layer(config: ModelConfig, layer: int, w: Weights, rotary: Rotary, tp_rank: int,
                tp_size: int) -> llama.DecoderLayer:
    return llama.build_layer(config, layer, w, rotary, tp_rank, tp_size, mlp=mlp)

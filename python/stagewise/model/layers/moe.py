"""A sparse mixture of SwiGLU experts with a softmax top-k router (Qwen3-MoE).

Router: softmax over the experts in float32, top-k, renormalised when ``norm_topk_prob``. Under
tensor parallelism every rank holds every expert's block of the intermediate dim (its columns of
gate and up, its rows of the down projection's inputs) and the router whole, so each rank routes
alike and produces partial sums that ``all_reduce`` adds up.
"""

from __future__ import annotations

import torch
from torch import nn

from stagewise.model.layers.linear import AllReduce, dense_linear
from stagewise.model.layers.mlp import activation


class SparseMoE(nn.Module):
    """Top-k routed experts over this rank's ``gate_up [E, 2 * I_local, hidden]`` (gate rows, then up
    rows) and ``down [E, hidden, I_local]``."""

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                 norm_topk_prob: bool, act: str, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[:1] != down.shape[:1] \
                or gate_up.size(1) != 2 * down.size(2) or gate_up.size(2) != down.size(1):
            raise ValueError(f"SparseMoE: expected gate_up [E, 2I, hidden] and down [E, hidden, I], got "
                             f"{list(gate_up.shape)} and {list(down.shape)}")
        self.router = nn.Parameter(router, requires_grad=False)  # [E, hidden]
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.top_k, self.norm_topk_prob, self.act = top_k, norm_topk_prob, activation(act)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        probs = torch.softmax(dense_linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        # One pass per expert over the tokens routed to it (in expert order, as HF sums them).
        for e in torch.unique(experts).tolist():
            tokens, slot = torch.where(experts == e)
            gate, up = dense_linear(x[tokens], self.gate_up[e]).chunk(2, dim=-1)
            y = dense_linear(self.act(gate) * up, self.down[e]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y)
        return out if self.all_reduce is None else self.all_reduce(out)

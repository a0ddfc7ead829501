"""Building blocks shared by the architectures: weights, TP-sharded linears, norms, MLPs.

Tensor parallelism follows the Megatron split of seed 004: a column-parallel
linear keeps rows ``[rank * out / tp, (rank + 1) * out / tp)`` of ``W [out, in]``
(whole outputs, no communication); a row-parallel linear keeps the matching
columns of ``W`` and returns partial sums that an all-reduce over the TP group
adds up. Only ``tp_size = 1`` runs today (no collectives are wired); the shard
shapes are already those of every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from stagewise import ops
from stagewise.model.quant import QuantizedWeight, cat_rows

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # HF "gelu" is the exact (erf) form
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(_ACTIVATIONS)}, got {name!r}")
    return _ACTIVATIONS[name]


class Weights:
    """HF-named tensors, cast to the stage's dtype and moved to its device when taken.

    A :class:`QuantizedWeight` keeps its blocks and takes the stage's dtype as its compute dtype."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str) -> None:
        self.tensors, self.dtype, self.device = tensors, dtype, torch.device(device)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str) -> torch.Tensor | QuantizedWeight:
        if name not in self.tensors:
            raise ValueError(f"Weights: the checkpoint has no tensor {name!r}")
        return self.tensors[name].to(device=self.device, dtype=self.dtype)

    def dense(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a dense tensor, dequantised if it is held in blocks."""
        w = self(name)
        return w.dequantize() if isinstance(w, QuantizedWeight) else w

    def get(self, name: str) -> torch.Tensor | None:
        return self(name) if name in self.tensors else None


def split(w, dim: int, tp_rank: int, tp_size: int, what: str = "weight"):
    """This rank's ``1 / tp_size`` of ``w`` along ``dim`` (contiguous copy; a tensor or a
    :class:`QuantizedWeight`, whose column slices must fall on block boundaries)."""
    if w.size(dim) % tp_size:
        raise ValueError(f"split: {what} size {w.size(dim)} along dim {dim} is not divisible by tp_size={tp_size}")
    n = w.size(dim) // tp_size
    return w.narrow(dim, tp_rank * n, n).contiguous()


def kv_head_shard(w: torch.Tensor, num_kv_heads: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's KV heads of a k/v projection ``[Hk * D, ...]``: ``Hk / tp`` of them, or, with
    fewer heads than ranks, the one head this rank shares with ``tp / Hk - 1`` others (replicated)."""
    if num_kv_heads >= tp_size:
        return split(w, 0, tp_rank, tp_size, "num_kv_heads")
    if tp_size % num_kv_heads:
        raise ValueError(f"kv_head_shard: tp_size={tp_size} must be a multiple of num_kv_heads={num_kv_heads}")
    head_dim = w.size(0) // num_kv_heads
    head = tp_rank * num_kv_heads // tp_size
    return w.narrow(0, head * head_dim, head_dim).contiguous()


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    return max(1, num_kv_heads // tp_size)


class Linear(nn.Module):
    """``y = x @ W.T + b`` with this rank's shard ``W [out_local, in_local]``: a dense tensor
    (F.linear) or a :class:`QuantizedWeight` (stagewise.ops.quant_linear)."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if isinstance(weight, QuantizedWeight):
            self.weight = weight  # its blocks, not a parameter
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def column(cls, parts: list[torch.Tensor], biases: list[torch.Tensor | None] | None,
               tp_rank: int, tp_size: int) -> Linear:
        """Column parallel over ``parts`` fused along the output dim (e.g. gate and up): each part
        is split on its own, so rank r holds ``[gate_r; up_r]``, not a slice of ``[gate; up]``."""
        weight = cat_rows([split(p, 0, tp_rank, tp_size) for p in parts])
        if biases is None or all(b is None for b in biases):
            return cls(weight)
        return cls(weight, torch.cat([split(b, 0, tp_rank, tp_size, "bias") for b in biases]))

    @classmethod
    def row(cls, weight: torch.Tensor, bias: torch.Tensor | None, tp_rank: int, tp_size: int) -> Linear:
        """Row parallel: rank r holds columns ``[r * in / tp, ...)``; the bias lives on rank 0 only,
        so the all-reduced sum counts it once."""
        return cls(split(weight, 1, tp_rank, tp_size), bias if tp_rank == 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            return self.weight.linear(x, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim via the stagewise ops, optionally adding the residual first."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual is None``: returns ``(norm(x), x)``. Otherwise in place ``residual += x`` and
        returns ``(norm(residual), residual)``; both tensors are overwritten."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


class LayerNorm(nn.Module):
    """LayerNorm with bias (Falcon); the ops library has no LayerNorm kernel, so torch's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(layer_norm(h), h)`` with ``h = x + residual`` (or ``x``): the interface of :class:`RMSNorm`."""
        if residual is not None:
            x = x + residual
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps), x


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (SwiGLU for silu), gate and up fused in one column linear."""

    def __init__(self, gate_up: Linear, down: Linear, act: str) -> None:
        super().__init__()
        self.gate_up, self.down, self.act = gate_up, down, activation(act)

    @classmethod
    def from_weights(cls, w: Weights, prefix: str, act: str, tp_rank: int, tp_size: int) -> GatedMLP:
        """HF names ``{prefix}gate_proj``, ``up_proj``, ``down_proj`` (``.weight``, optional ``.bias``)."""
        gate_up = Linear.column([w(f"{prefix}gate_proj.weight"), w(f"{prefix}up_proj.weight")],
                                [w.get(f"{prefix}gate_proj.bias"), w.get(f"{prefix}up_proj.bias")], tp_rank, tp_size)
        down = Linear.row(w(f"{prefix}down_proj.weight"), w.get(f"{prefix}down_proj.bias"), tp_rank, tp_size)
        return cls(gate_up, down, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class PlainMLP(nn.Module):
    """``down(act(up(x)))`` (Falcon's dense_h_to_4h / dense_4h_to_h)."""

    def __init__(self, up: Linear, down: Linear, act: str) -> None:
        super().__init__()
        self.up, self.down, self.act = up, down, activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))

"""Dense MLPs: gated (SwiGLU for silu; Llama, Qwen3) and plain (Falcon), column then row parallel."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from stagewise.model.layers.linear import Linear, RowParallelLinear

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


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, gate and up fused in one linear whose output is
    ``[gate_local, up_local]`` (this rank's columns of each)."""

    def __init__(self, gate_up: Linear, down: RowParallelLinear, act: str) -> None:
        super().__init__()
        self.gate_up, self.down, self.act = gate_up, down, activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class PlainMLP(nn.Module):
    """``down(act(up(x)))`` (Falcon's dense_h_to_4h / dense_4h_to_h)."""

    def __init__(self, up: Linear, down: RowParallelLinear, act: str) -> None:
        super().__init__()
        self.up, self.down, self.act = up, down, activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        return self.down(self.act(self.up(x)))

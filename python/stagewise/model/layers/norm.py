"""RMSNorm (through the stagewise ops) and LayerNorm, both with an optional residual added first."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stagewise import ops


class RMSNorm(nn.Module):
    """RMSNorm over the last dim via the stagewise ops, optionally adding the residual first; with
    ``unit_offset`` Gemma's, which scales by ``1 + weight`` (:func:`stagewise.ops.rms_norm`)."""

    def __init__(self, weight: torch.Tensor, eps: float, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual is None``: returns ``(norm(x), x)``. Otherwise in place ``residual += x`` and
        returns ``(norm(residual), residual)``; both tensors are overwritten."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, unit_offset=self.unit_offset), x
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps, unit_offset=self.unit_offset)
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

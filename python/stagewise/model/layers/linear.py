"""Linear layers over weights the loader already cut for this rank (they never split a tensor).

``W [out, in]`` is a dense tensor (:func:`dense_linear`) or a :class:`QuantizedWeight` in GGUF
blocks (``stagewise.ops.quant_linear``). Under tensor parallelism a column-parallel (or replicated)
:class:`Linear` holds whole outputs and needs no communication. A :class:`RowParallelLinear`
holds a block of the inputs and produces partial sums; its ``all_reduce`` adds them up across the
TP group, and only then is the bias (whole on every rank) added, so it counts once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from stagewise import ops
from stagewise.model.collectives import Collectives
from stagewise.model.quant import QuantizedWeight, cat_rows

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Returns the elementwise sum of its argument over the tensor-parallel group (every rank gets it)."""


def tp_all_reduce(tp: Collectives) -> AllReduce | None:
    """What the row-parallel layers of a rank of ``tp`` reduce with: ``tp.all_reduce``, or None on
    one rank, where they are the plain layers (and the C++ decode loop can take them)."""
    return None if tp.size == 1 else tp.all_reduce


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for a dense ``w [out, in]``: on the CPU :func:`stagewise.ops.dense_linear` (which
    picks its GEMV kernel or a BLAS GEMM), elsewhere ``F.linear``. The decoder layers' dense linears,
    the experts' and the LM head's come here, and the C++ decode loop calls the same op: one rule,
    the same bits."""
    if w.device.type == "cpu":
        return ops.dense_linear(x, w, bias)
    return F.linear(x, w, bias)


def _weight(w: torch.Tensor | QuantizedWeight) -> nn.Parameter | QuantizedWeight:
    return w.for_linear() if isinstance(w, QuantizedWeight) else nn.Parameter(w.contiguous(), requires_grad=False)


def _linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(w, QuantizedWeight):
        return w.linear(x, bias)
    return dense_linear(x, w, bias)


class Linear(nn.Module):
    """``y = x @ W.T + b`` with this rank's ``W [out_local, in]`` (whole outputs: column parallel or
    replicated)."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = _weight(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def fused(cls, weights: Sequence[torch.Tensor | QuantizedWeight],
              biases: Sequence[torch.Tensor | None] | None = None) -> Linear:
        """One linear computing several at once (e.g. q, k and v): their weights stacked along the
        output dim, so the output is ``[y_0, y_1, ...]``."""
        weight = cat_rows(list(weights))
        if biases is None or all(b is None for b in biases):
            return cls(weight)
        if any(b is None for b in biases):
            raise ValueError("Linear.fused: either every part has a bias or none has")
        return cls(weight, torch.cat(list(biases)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r @ W_r.T) + b``: ``W_r [out, in_local]`` this rank's block of the inputs,
    ``x_r`` the matching block of features, ``b [out]`` whole. ``all_reduce`` None: one rank, and
    ``y = dense_linear(x, W, b)`` exactly."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
                 all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        self.weight = _weight(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is None:
            return _linear(x, self.weight, self.bias)
        y = self.all_reduce(_linear(x, self.weight, None))
        return y if self.bias is None else y + self.bias

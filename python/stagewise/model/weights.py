"""A stage's named weights as the architectures take them: cast to the stage's dtype and moved to
its device one tensor at a time, so that only the built layers hold converted copies."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from stagewise.model.quant import QuantizedWeight


class Weights:
    """HF-named tensors (as :func:`stagewise.model.loader.load_stage_weights` returns them), cast to
    the stage's dtype and moved to its device when taken.

    A :class:`QuantizedWeight` keeps its blocks and takes the stage's dtype as its compute dtype."""

    def __init__(self, tensors: Mapping[str, torch.Tensor | QuantizedWeight], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.tensors, self.dtype, self.device = tensors, dtype, torch.device(device)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str) -> torch.Tensor | QuantizedWeight:
        if name not in self.tensors:
            raise ValueError(f"Weights: the stage's weights have no tensor {name!r}")
        return self.tensors[name].to(device=self.device, dtype=self.dtype)

    def dense(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a dense tensor, dequantised if it is held in blocks."""
        w = self(name)
        return w.dequantize() if isinstance(w, QuantizedWeight) else w

    def get(self, name: str) -> torch.Tensor | QuantizedWeight | None:
        return self(name) if name in self.tensors else None

"""What the loader reads from: a :class:`Checkpoint`.

A checkpoint knows every tensor's HF name, shape and stored dtype from the file headers alone and
reads one tensor (or one slice of it) at a time, so a pipeline stage, and a tensor-parallel rank
of it, only ever touches its own share of the weights. ``bytes_read`` counts the tensor bytes taken
from disk. The formats: :class:`~stagewise.model.loader.hf_folder.HFCheckpoint` (safetensors) and
:class:`~stagewise.model.loader.gguf_file.GGUFCheckpoint`; :func:`~stagewise.model.loader.open_checkpoint`
picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from stagewise.model.config import ModelConfig
from stagewise.model.quant import QuantizedWeight


class Checkpoint(ABC):
    """The interface every checkpoint format implements."""

    path: Path
    hf_config: dict[str, Any]
    """The HF config.json dict (for a GGUF file: built from its metadata)."""
    config: ModelConfig
    chat_template: str | None
    bytes_read: int

    @abstractmethod
    def names(self) -> set[str]:
        """HF names of every tensor in the checkpoint."""

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """HF shape of tensor ``name`` (from the header; nothing is read)."""

    @abstractmethod
    def dtype(self, name: str) -> torch.dtype:
        """dtype :meth:`read` returns for ``name`` (quantized GGUF tensors dequantize to float32)."""

    @abstractmethod
    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or only ``[start, stop)`` along ``dim`` when ``dim`` is given."""

    def qtype(self, name: str) -> int | None:
        """GGML type id of ``name`` when it is a matrix in blocks :func:`stagewise.ops.quant_linear`
        takes (Q4_0, Q4_1, Q8_0), else None."""
        return None

    def read_quantized(self, name: str, dim: int | None = None, start: int = 0,
                       stop: int | None = None) -> QuantizedWeight:
        """Tensor ``name`` kept in its blocks (only when :meth:`qtype` is not None); slicing as :meth:`read`."""
        raise ValueError(f"checkpoint {str(self.path)!r}: tensor {name!r} is not block-quantised")

    @abstractmethod
    def tokenizer(self):
        """The checkpoint's tokenizers.Tokenizer."""

    def missing(self, name: str) -> KeyError:
        """The error for a tensor the checkpoint does not hold."""
        return KeyError(f"checkpoint {str(self.path)!r}: no tensor named {name!r}")

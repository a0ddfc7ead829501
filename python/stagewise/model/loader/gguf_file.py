"""A llama.cpp GGUF file, read through its memory map (:mod:`stagewise.model.loader.gguf_reader`),
with its tensors, config and tokenizer named and shaped as in HF
(see :mod:`stagewise.model.loader.gguf_map`). Opening it reads the header only: the tokenizer's
arrays are parsed when :meth:`GGUFCheckpoint.tokenizer` asks, a tensor's bytes when it is read."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import torch

import stagewise.model.loader.gguf_map as gguf_map
from stagewise import ops
from stagewise.model import architectures
from stagewise.model.hf_config import parse_hf_config
from stagewise.model.loader.checkpoint import Checkpoint
from stagewise.model.loader.gguf_reader import GGUF_PLAIN, ArrayRef, GGUFHeader
from stagewise.model.quant import QuantizedWeight


class GGUFCheckpoint(Checkpoint):
    """A llama.cpp GGUF file, read through its memory map."""

    _PLAIN = {"F32": torch.float32, "F16": torch.float16}

    def __init__(self, file: str | Path) -> None:
        self.path = Path(file)
        if not self.path.is_file():
            raise FileNotFoundError(f"checkpoint: no GGUF file at {str(self.path)!r}")
        try:
            self._header = GGUFHeader(self.path)  # a ValueError that names the file and what is wrong
        except OSError as err:
            raise ValueError(f"checkpoint: cannot read the GGUF file {str(self.path)!r}: {err}") from None
        self._meta = {k: v for k, v in self._header.metadata.items() if not isinstance(v, ArrayRef)}
        self._arch = architectures.for_gguf(self._meta.get("general.architecture"))
        self._tensors = {}
        for t in self._header.tensors:
            hf = gguf_map.hf_tensor_name(self._arch, t.name)
            if hf is not None:
                self._tensors[hf] = t
        self.hf_config = gguf_map.hf_config_from_gguf(self._meta, self._header.array_len("tokenizer.ggml.tokens"),
                                                      has_output="lm_head.weight" in self._tensors)
        self.config = parse_hf_config(self.hf_config)
        self.chat_template = self._meta.get("tokenizer.chat_template")
        self.bytes_read = 0

    def tokenizer(self):
        h = self._header
        # ~100,000 small strings and tuples in a row: the cyclic GC's passes over them would add a third.
        paused = gc.isenabled()
        gc.disable()
        try:
            tokens = h.array("tokenizer.ggml.tokens")
            if not tokens:
                raise ValueError(f"checkpoint: {str(self.path)!r} stores no tokenizer (tokenizer.ggml.tokens)")
            return gguf_map.gpt2_tokenizer(self._meta, tokens, h.array("tokenizer.ggml.merges") or [],
                                           h.array("tokenizer.ggml.token_type"))
        finally:
            if paused:
                gc.enable()

    def tensor_bytes(self) -> int:
        """Bytes of every tensor the model reads, as the file stores them."""
        return sum(t.n_bytes for t in self._tensors.values())

    def names(self) -> set[str]:
        return set(self._tensors)

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise self.missing(name)
        return self._tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._tensors:
            raise self.missing(name)
        return tuple(int(d) for d in reversed(self._tensors[name].shape))  # GGUF lists dims innermost first

    def dtype(self, name: str) -> torch.dtype:
        kind = self._tensor(name).tensor_type.name
        return torch.bfloat16 if kind == "BF16" else self._PLAIN.get(kind, torch.float32)

    def _view(self, name: str, dim: int | None, start: int, stop: int | None
              ) -> tuple[np.ndarray, int, tuple[int, int, int] | None]:
        """``(data, heads, rest)``: the stored values or blocks of ``[start, stop)`` along ``dim`` as a
        view of the file (only they are read), the head count to un-permute their rows with
        (llama Q/K; 0: none), and the ``(dim, start, length)`` still to cut once they are converted
        (a row cut through a Q/K head, a column cut through a block), else None."""
        t = self._tensor(name)
        data, shape = self._header.data(t), self.shape(name)
        heads = 0
        if gguf_map.needs_unpermute(self._arch, t.name):
            heads = self.config.num_heads if ".attn_q." in t.name else self.config.num_kv_heads
        if dim is None:
            return data, heads, None
        stop = shape[dim] if stop is None else stop
        if dim == 0:
            per_head = shape[0] // heads if heads else 1
            if start % per_head or stop % per_head:  # the head permutation needs whole heads
                return data, heads, (0, start, stop - start)
            return data[start:stop], (stop - start) // per_head if heads else 0, None
        if t.tensor_type.name in GGUF_PLAIN:
            return data[:, start:stop], heads, None
        block, nbytes = t.tensor_type.block, t.tensor_type.block_bytes
        first, last = start // block, -(-stop // block)
        rest = (1, start - first * block, stop - start) if start % block or stop % block else None
        return data[:, first * nbytes:last * nbytes], heads, rest

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        t = self._tensor(name)
        kind = t.tensor_type.name
        data, heads, rest = self._view(name, dim, start, stop)
        if kind in self._PLAIN:
            tensor = gguf_map.numpy_to_torch(data)
        else:  # quantized (and bf16, exactly representable in float32) -> float32
            import gguf  # only here: importing it costs ~0.1 s of start-up (its YAML)

            try:
                values = gguf.quants.dequantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType(t.tensor_type.id))
            except NotImplementedError:
                raise ValueError(f"checkpoint {str(self.path)!r}: tensor {t.name!r} has GGML type {kind}, "
                                 "which cannot be loaded (no dequantization for it)") from None
            tensor = torch.from_numpy(values).to(self.dtype(name))
        self.bytes_read += int(data.nbytes)
        if heads:
            tensor = gguf_map.unpermute_qk(tensor, heads)
        if rest is not None:
            tensor = tensor.narrow(*rest).contiguous()
        adjust = self._arch.gguf.adjust
        return tensor if adjust is None else adjust(name, tensor)

    def qtype(self, name: str) -> int | None:
        t = self._tensor(name)
        return ops.QTYPES.get(t.tensor_type.name) if len(t.shape) == 2 else None

    def read_quantized(self, name: str, dim: int | None = None, start: int = 0,
                       stop: int | None = None) -> QuantizedWeight:
        """The GGUF rows as they are (``[out, in / 32 * block_bytes]`` uint8); a slice reads only its
        rows, or its blocks of each row (a cut of ``in`` must keep whole blocks)."""
        qtype = self.qtype(name)
        if qtype is None:
            return super().read_quantized(name)
        t = self._tensor(name)
        data, heads, rest = self._view(name, dim, start, stop)
        cols = data.shape[1] // t.tensor_type.block_bytes * t.tensor_type.block
        weight = QuantizedWeight(gguf_map.numpy_to_torch(data), qtype, cols)
        self.bytes_read += weight.data.numel()
        if heads:
            weight = weight.map_rows(lambda d: gguf_map.unpermute_qk(d, heads))
        if rest is not None:
            weight = weight.narrow(*rest)
        return weight

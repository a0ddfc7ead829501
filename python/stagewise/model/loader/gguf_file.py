"""A llama.cpp GGUF file, read through its memory map (:mod:`stagewise.model.loader.gguf_reader`),
with its tensors, config and tokenizer named and shaped as in HF
(see :mod:`stagewise.model.loader.gguf_map`). Opening it reads the header only: the tokenizer's
arrays are parsed when :meth:`GGUFCheckpoint.tokenizer` asks, a tensor's bytes when it is read."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

import stagewise.model.loader.gguf_map as gguf_map
from stagewise import ops
from stagewise.model.hf_config import parse_hf_config
from stagewise.model.loader.checkpoint import Checkpoint
from stagewise.model.loader.gguf_reader import ArrayRef, GGUFHeader
from stagewise.model.quant import QuantizedWeight


class GGUFCheckpoint(Checkpoint):
    """A llama.cpp GGUF file, read through its memory map."""

    _PLAIN = {"F32": torch.float32, "F16": torch.float16}

    def __init__(self, file: str | Path) -> None:
        self.path = Path(file)
        if not self.path.is_file():
            raise FileNotFoundError(f"checkpoint: no GGUF file at {str(self.path)!r}")
        try:
            self._header = GGUFHeader(self.path)
        except (ValueError, OSError) as err:
            raise ValueError(f"checkpoint: {str(self.path)!r} is not a readable GGUF file "
                             f"(truncated or corrupt?): {err}") from None
        self._meta = {k: v for k, v in self._header.metadata.items() if not isinstance(v, ArrayRef)}
        self._arch = self._meta.get("general.architecture")
        self._tensors = {}
        for t in self._header.tensors:
            hf = gguf_map.hf_tensor_name(t.name)
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

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        import gguf

        t = self._tensor(name)
        kind = t.tensor_type.name
        if kind in self._PLAIN:
            tensor = gguf_map.numpy_to_torch(self._header.data(t))
        else:  # quantized (and bf16, exactly representable in float32) -> float32
            try:
                values = gguf.quants.dequantize(self._header.data(t), gguf.GGMLQuantizationType(t.tensor_type.id))
            except NotImplementedError:
                raise ValueError(f"checkpoint {str(self.path)!r}: tensor {t.name!r} has GGML type {kind}, "
                                 "which cannot be loaded (no dequantization for it)") from None
            tensor = torch.from_numpy(values).to(self.dtype(name))
        tensor = tensor.reshape(self.shape(name))
        self.bytes_read += int(t.n_bytes)
        if gguf_map.needs_unpermute(self._arch, t.name):
            heads = self.config.num_heads if ".attn_q." in t.name else self.config.num_kv_heads
            tensor = gguf_map.unpermute_qk(tensor, heads)
        if dim is not None:
            stop = tensor.shape[dim] if stop is None else stop
            tensor = tensor.narrow(dim, start, stop - start).contiguous()
        return tensor

    def qtype(self, name: str) -> int | None:
        t = self._tensor(name)
        return ops.QTYPES.get(t.tensor_type.name) if len(t.shape) == 2 else None

    def read_quantized(self, name: str, dim: int | None = None, start: int = 0,
                       stop: int | None = None) -> QuantizedWeight:
        """The GGUF rows as they are (``[out, in / 32 * block_bytes]`` uint8); a row slice reads
        only its rows, except for llama Q/K, whose head permutation needs every row first."""
        qtype = self.qtype(name)
        if qtype is None:
            return super().read_quantized(name)
        t = self._tensor(name)
        rows, cols = self.shape(name)
        data = self._header.data(t)  # the memory-mapped [rows, row_bytes] uint8 blocks
        permute = gguf_map.needs_unpermute(self._arch, t.name)
        if dim == 0 and not permute:
            stop = rows if stop is None else stop
            data, dim = data[start:stop], None
        weight = QuantizedWeight(gguf_map.numpy_to_torch(data), qtype, cols)
        self.bytes_read += weight.data.numel()
        if permute:
            heads = self.config.num_heads if ".attn_q." in t.name else self.config.num_kv_heads
            weight = weight.map_rows(lambda d: gguf_map.unpermute_qk(d, heads))
        if dim is not None:
            stop = weight.size(dim) if stop is None else stop
            weight = weight.narrow(dim, start, stop - start)
        return weight

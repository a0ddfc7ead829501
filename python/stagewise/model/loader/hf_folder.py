"""An HF checkpoint folder: ``config.json`` plus ``model.safetensors`` or the shards a
``model.safetensors.index.json`` names, read tensor by tensor (or slice by slice) through
safetensors' memory map."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from stagewise.model.hf_config import parse_hf_config, read_config_json
from stagewise.model.loader.checkpoint import Checkpoint


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
            raise self.missing(name)
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        if name not in self._meta:
            raise self.missing(name)
        return self._meta[name][1]

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if name not in self._file_of:
            raise self.missing(name)
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

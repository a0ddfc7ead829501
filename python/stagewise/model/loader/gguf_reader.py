"""A GGUF file's header, read once and lazily: :class:`GGUFHeader`.

gguf.GGUFReader builds a numpy view for every element of every metadata array, the vocabulary's
~50,000 tokens and merges included, which takes seconds; a stage needs none of them. This reader
keeps each array where it lies in the file and parses it only when asked (:meth:`GGUFHeader.array`),
reads scalars and strings, and maps the tensor data once (numpy.memmap): a tensor is a view of its
bytes, read from disk when touched. Layout (GGUF v2/v3, little-endian; github.com/ggml-org/ggml
docs/gguf.md): magic, version u32, tensor count u64, metadata count u64, the metadata (key string,
value type u32, value), the tensor infos (name, dims u32, dims u64 each innermost first, type u32,
offset u64), then the data, aligned to ``general.alignment`` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
DEFAULT_ALIGNMENT = 32
# GGML tensor types (ggml.h `enum ggml_type`): id -> (name, weights a block, bytes a block). The
# common ones are here, so that opening a file does not import the gguf package (~0.1 s, it loads
# YAML among others); any other type is looked up there.
_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
          7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
          12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
          24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
          30: ("BF16", 1, 2)}
_PLAIN_TENSORS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}
GGUF_PLAIN = frozenset(_PLAIN_TENSORS)
"""Types whose :meth:`GGUFHeader.data` are typed values (the others: raw bytes of blocks)."""


@dataclass(frozen=True, slots=True)
class TensorType:
    """A GGML tensor type: its id, name and block (weights, bytes)."""

    id: int
    name: str
    block: int
    block_bytes: int

    @staticmethod
    def of(type_id: int) -> TensorType:
        if type_id in _TYPES:
            return TensorType(type_id, *_TYPES[type_id])
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        kind = GGMLQuantizationType(type_id)  # ValueError for an id ggml does not know
        return TensorType(type_id, kind.name, *GGML_QUANT_SIZES[kind])


@dataclass(frozen=True, slots=True)
class ArrayRef:
    """A metadata array left in the file: element type, count and where its elements start."""

    kind: int
    count: int
    offset: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the file: ``shape`` innermost first, as GGUF stores it."""

    name: str
    shape: tuple[int, ...]
    tensor_type: TensorType
    offset: int
    """Of its first byte in the file."""
    n_bytes: int


class GGUFHeader:
    """The metadata and tensor infos of a GGUF file, and its tensors as views of a memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._at = 0
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # ValueError when empty
            self._parse()
        except (IndexError, UnicodeDecodeError, ValueError) as err:
            raise ValueError(f"gguf: {str(self.path)!r} is not a readable GGUF file (truncated or corrupt?): "
                             f"{err}") from None
        self._data: np.memmap | None = None

    # ---- parsing --------------------------------------------------------------------------

    def _unpack(self, fmt: str) -> Any:
        if self._at + struct.calcsize(fmt) > len(self._mm):
            raise ValueError(f"the header runs past the end of the file ({len(self._mm)} bytes)")
        (value,) = struct.unpack_from(fmt, self._mm, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        start, self._at = self._at, self._at + n
        if self._at > len(self._mm):
            raise ValueError(f"a string of {n} bytes at {start} runs past the end of the file")
        return self._mm[start:self._at].decode("utf-8")

    def _skip_strings(self, count: int) -> None:
        mm, at = self._mm, self._at
        for _ in range(count):
            at += 8 + int.from_bytes(mm[at:at + 8], "little")
        if at > len(mm):
            raise ValueError("an array of strings runs past the end of the file")
        self._at = at

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        elem, count = self._unpack("<I"), self._unpack("<Q")
        ref = ArrayRef(elem, count, self._at)
        if elem == _STRING:
            self._skip_strings(count)
        elif elem in _SCALARS:
            self._at += count * struct.calcsize(_SCALARS[elem])
        else:  # arrays of arrays: no file we load has them; walk them to stay in step
            for _ in range(count):
                self._value(elem)
        return ref

    def _parse(self) -> None:
        magic = bytes(self._mm[0:4])
        if magic != b"GGUF":
            raise ValueError(f"magic {magic!r}, expected b'GGUF'")
        self._at = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"version {version} (byte-swapped: a big-endian file?), expected 2 or 3")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict[str, Any] = {}
        """Scalars and strings by key; arrays as :class:`ArrayRef` (read them with :meth:`array`)."""
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            kind, offset = TensorType.of(self._unpack("<I")), self._unpack("<Q")
            infos.append((name, dims, kind, offset))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        start = -(-self._at // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        for name, dims, kind, offset in infos:
            n_bytes = int(np.prod(dims, dtype=np.int64)) // kind.block * kind.block_bytes
            if start + offset + n_bytes > len(self._mm):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            self.tensors.append(TensorInfo(name, dims, kind, start + offset, n_bytes))

    # ---- access ---------------------------------------------------------------------------

    def array_len(self, key: str) -> int | None:
        ref = self.metadata.get(key)
        return ref.count if isinstance(ref, ArrayRef) else None

    def array(self, key: str) -> list | None:
        """The metadata array ``key`` as a list (strings decoded), or None when there is none."""
        ref = self.metadata.get(key)
        if not isinstance(ref, ArrayRef):
            return None
        if ref.kind in _NUMPY:
            return np.frombuffer(self._mm, dtype=_NUMPY[ref.kind], count=ref.count, offset=ref.offset).tolist()
        if ref.kind == _STRING:  # the vocabulary's tens of thousands: one tight loop
            mm, at, out = self._mm, ref.offset, []
            for _ in range(ref.count):
                n = int.from_bytes(mm[at:at + 8], "little")
                out.append(mm[at + 8:at + 8 + n].decode("utf-8"))
                at += 8 + n
            return out
        self._at = ref.offset
        return [self._value(ref.kind) for _ in range(ref.count)]

    def data(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only view of the file, outermost dim first: typed values
        ``[..., ne0]`` for plain types, the raw blocks ``[..., row bytes]`` uint8 otherwise."""
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._data[t.offset:t.offset + t.n_bytes]
        rows = tuple(reversed(t.shape[1:]))
        kind = t.tensor_type
        if kind.name in _PLAIN_TENSORS:
            return raw.view(_PLAIN_TENSORS[kind.name]).reshape(*rows, t.shape[0])
        return raw.reshape(*rows, t.shape[0] // kind.block * kind.block_bytes)

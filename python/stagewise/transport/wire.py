"""The wire format's constants, read from their one table in the extension.

``include/stagewise/frame.h`` holds every constant of the frame format (sizes, field offsets,
limits, magic, version, flag bits, dtype codes and element sizes, the number of step kinds);
``stagewise._C.frame_constants()`` hands it to Python, and this module builds the ``struct``
formats of the header, the row entry and the tensor entry from its field lists. The C++ fast
path and the Python reference therefore read one table; ``docs/wire-format.md`` documents it and
``tests/transport/test_wire.py`` pins it with golden bytes written independently.
"""

from __future__ import annotations

import collections
import struct

from stagewise import _C

_TABLE = _C.frame_constants()

MAGIC: bytes = _TABLE["magic"]
VERSION: int = _TABLE["version"]
ALIGN: int = _TABLE["align"]
"""The payload and each tensor in it start at a multiple of this many bytes."""
MAX_ROWS: int = _TABLE["max_rows"]
MAX_TENSORS: int = _TABLE["max_tensors"]
MAX_CONTROL_BYTES: int = _TABLE["max_control_bytes"]
MAX_NDIM: int = _TABLE["max_ndim"]
"""Most dimensions of one tensor (a KV block table [layers, blocks, block_size, heads, dim] needs 5)."""
MAX_NAME_BYTES: int = _TABLE["max_name_bytes"]
"""Longest tensor name, in UTF-8 bytes."""
DEFAULT_MAX_PAYLOAD_BYTES: int = _TABLE["default_max_payload_bytes"]
"""Tensor bytes one frame may carry unless the receiver says otherwise (a long request's KV handoff
for one stage can reach a gigabyte)."""
NUM_STEP_KINDS: int = _TABLE["num_step_kinds"]
STEP_CONTROL: int = _TABLE["step_control"]
STEP_HELLO: int = _TABLE["step_hello"]
LAYOUT_CONTIGUOUS: int = _TABLE["layout_contiguous"]
FLAG_CHECKSUM: int = _TABLE["flag_checksum"]
"""Header ``frame_flags`` bit: the checksum field holds the frame's CRC32C."""
FLAG_DETACHED_PAYLOAD: int = _TABLE["flag_detached_payload"]
"""Header ``frame_flags`` bit: a descriptor frame, whose tensors' bytes lie outside it (a ring slot)."""
FRAME_FLAG_BITS: int = FLAG_CHECKSUM | FLAG_DETACHED_PAYLOAD
ROW_FLAG_BITS: int = _TABLE["row_flag_bits"]
DTYPES: dict[int, tuple[str, int]] = {code: (name, itemsize) for code, name, itemsize in _TABLE["dtypes"]}
"""Wire dtype code -> (name, element bytes)."""


def _record(name: str, fields) -> struct.Struct:
    """The little-endian struct of a record from the table's (name, offset, size, format,
    count) entries; the offsets must follow each other."""
    fmt, at = "<", 0
    for field, offset, size, code, count in fields:
        if offset != at:
            raise RuntimeError(f"stagewise._C.frame_constants: {name}.{field} at {offset}, expected {at}")
        fmt += f"{size}s" if code == "s" else f"{count if count > 1 else ''}{code}"
        at += size
    packed = struct.Struct(fmt)
    if packed.size != at:
        raise RuntimeError(f"stagewise._C.frame_constants: {name} is {at} bytes, its format {fmt!r} {packed.size}")
    return packed


HEADER = _record("header", _TABLE["header"])
"""80 bytes; ``Header._make(HEADER.unpack_from(buf))`` names the fields."""
Header = collections.namedtuple("Header", [field[0] for field in _TABLE["header"]])
ROW = _record("row", _TABLE["row"])
"""24 bytes: request_id, first_position, num_tokens, flags, reserved."""
TENSOR = _record("tensor", _TABLE["tensor"])
"""80 bytes: name, dtype, ndim, reserved0, reserved1, offset, nbytes, then MAX_NDIM dims."""
HEADER_OFFSETS: dict[str, int] = {field[0]: field[1] for field in _TABLE["header"]}
CHECKSUM_OFFSET: int = HEADER_OFFSETS["checksum"]


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN

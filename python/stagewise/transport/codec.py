"""Frame <-> bytes. The byte table is in ``docs/wire-format.md``; the struct formats below are it.

A frame is: an 80-byte little-endian header, ``num_rows`` 24-byte row entries, ``num_tensors``
80-byte tensor entries, ``control_bytes`` of UTF-8 JSON, zero padding to a multiple of 64, then the
payload: each tensor's bytes at a 64-aligned offset (zero padding between them). The checksum is
XXH3-64 (seed 0) of the whole frame with the checksum field set to zero.

Nothing here knows about sockets: the same bytes go over TCP, torch.distributed or a shared-memory
ring. :func:`encode_parts` gives the frame as a list of buffers (header and tables, then the
tensors' own memory), so that a sender can hand them to ``sendmsg`` or copy them into a ring slot
without building the frame in between.

Two implementations of one format: the functions below named ``_*_reference`` are the codec in
plain Python, and the public functions first try the fast path of the extension
(``stagewise._C.frame_head`` / ``frame_fill`` / ``frame_parse``, ``csrc/bindings/frame_py.cpp``),
which handles the frames of a running pipeline (contiguous CPU tensors, fields in range) and
*declines* anything else: a declined frame goes through the reference, which raises the precise
error. A frame the fast path accepts is one the reference accepts, with the same bytes or the
same decoded frame (``tests/test_wire.py`` compares the two on fuzzed frames).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import warnings

import torch

from stagewise import _C
from stagewise.transport import checksum as xxh
from stagewise.transport.errors import FrameError
from stagewise.transport.frame import (
    DEFAULT_MAX_PAYLOAD_BYTES, MAGIC, MAX_CONTROL_BYTES, MAX_NAME_BYTES, MAX_NDIM, MAX_ROWS, MAX_TENSORS, VERSION,
    Frame, Layout, Row, RowFlags, StepKind, WireDType, shape_fields,
)  # fmt: skip

HEADER = struct.Struct("<4sHBBBBHHHQQIIIIIHHIIQQ")
ROW = struct.Struct("<QIIII")
TENSOR = struct.Struct(f"<{MAX_NAME_BYTES}sBBHIQQ{MAX_NDIM}I")
ALIGN = 64
CHECKSUM_OFFSET = 72
FLAG_CHECKSUM = 1
"""Header ``frame_flags`` bit 0: the checksum field holds XXH3-64 of the frame."""
_U16, _U32, _U64 = (1 << 16) - 1, (1 << 32) - 1, (1 << 64) - 1
_ROW_FLAG_BITS = sum(int(f) for f in RowFlags)
_ZEROS = bytes(ALIGN)

assert HEADER.size == 80 and ROW.size == 24 and TENSOR.size == 80


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _check_range(name: str, value: int, top: int) -> None:
    if not isinstance(value, int) or not 0 <= value <= top:
        raise ValueError(f"stagewise.transport: Frame.{name} must be an integer in [0, {top}], got {value!r}")


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, row-major: a view of its memory when it is a contiguous CPU tensor."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _control_bytes(frame: Frame) -> bytes:
    if frame.control is None:
        if frame.step_kind in (StepKind.CONTROL, StepKind.HELLO):
            raise ValueError(f"stagewise.transport: a {frame.step_kind.name} frame needs Frame.control (a dict)")
        return b""
    if not isinstance(frame.control, dict):
        raise TypeError(f"stagewise.transport: Frame.control must be a dict or None, got {type(frame.control).__name__}")
    data = json.dumps(frame.control, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    if len(data) > MAX_CONTROL_BYTES:
        raise ValueError(f"stagewise.transport: Frame.control is {len(data)} bytes of JSON, above {MAX_CONTROL_BYTES}")
    return data


def _encode_parts_reference(frame: Frame, *, checksum: bool = True) -> tuple[bytearray, list[memoryview | bytes]]:
    """:func:`encode_parts` in plain Python: every frame, every error."""
    _check_range("request_id", frame.request_id, _U64)
    _check_range("step_id", frame.step_id, _U64)
    for name in ("microbatch", "stage_from", "stage_to"):
        _check_range(name, getattr(frame, name), _U16)
    _check_range("token_index", frame.token_index, _U32)
    step_kind, layout = StepKind(frame.step_kind), Layout(frame.layout)
    if len(frame.rows) > MAX_ROWS or len(frame.tensors) > MAX_TENSORS:
        raise ValueError(f"stagewise.transport: a frame holds at most {MAX_ROWS} rows and {MAX_TENSORS} tensors, "
                         f"got {len(frame.rows)} and {len(frame.tensors)}")  # fmt: skip
    control = _control_bytes(frame)

    entries, parts, offset = [], [], 0
    for name, t in frame.tensors.items():
        raw = name.encode() if isinstance(name, str) else b""
        if not 0 < len(raw) <= MAX_NAME_BYTES or b"\0" in raw:
            raise ValueError(f"stagewise.transport: tensor name must be 1-{MAX_NAME_BYTES} UTF-8 bytes without NUL, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"stagewise.transport: Frame.tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        wire = WireDType.from_torch(t.dtype)
        if t.dim() > MAX_NDIM or any(d > _U32 for d in t.shape):
            raise ValueError(f"stagewise.transport: Frame.tensors[{name!r}] has shape {tuple(t.shape)}; "
                             f"at most {MAX_NDIM} dimensions of at most {_U32} each")  # fmt: skip
        data = _tensor_bytes(t)
        dims = list(t.shape) + [0] * (MAX_NDIM - t.dim())
        if _align(offset) > offset:
            parts.append(_ZEROS[: _align(offset) - offset])
            offset = _align(offset)
        entries.append(TENSOR.pack(raw, wire, t.dim(), 0, 0, offset, data.nbytes, *dims))
        if data.nbytes:
            parts.append(data)
        offset += data.nbytes

    primary = frame.primary
    if primary is None:
        frame.batch = frame.seq = frame.hidden_size = 0
        frame.dtype = None
    else:
        frame.batch, frame.seq, frame.hidden_size = shape_fields(tuple(primary.shape))
        frame.dtype = WireDType.from_torch(primary.dtype)
        for name in ("batch", "seq", "hidden_size"):
            _check_range(name, getattr(frame, name), _U32)
    rows = []
    for i, r in enumerate(frame.rows):
        _check_range(f"rows[{i}].request_id", r.request_id, _U64)
        _check_range(f"rows[{i}].first_position", r.first_position, _U32)
        _check_range(f"rows[{i}].num_tokens", r.num_tokens, _U32)
        rows.append(ROW.pack(r.request_id, r.first_position, r.num_tokens, int(r.flags), 0))
    frame.payload_bytes = offset
    frame.magic, frame.version = MAGIC, VERSION

    head_len = _align(HEADER.size + ROW.size * len(rows) + TENSOR.size * len(entries) + len(control))
    head = bytearray(head_len)
    HEADER.pack_into(
        head, 0, MAGIC, VERSION, step_kind, 0 if frame.dtype is None else frame.dtype, layout,
        FLAG_CHECKSUM if checksum else 0, frame.stage_from, frame.stage_to, frame.microbatch,
        frame.request_id, frame.step_id, frame.batch, frame.seq, frame.hidden_size, frame.token_index,
        len(rows), len(entries), 0, len(control), 0, offset, 0,
    )  # fmt: skip
    pos = HEADER.size
    for chunk in (*rows, *entries, control):
        head[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    frame.checksum = xxh.digest([head, *parts]) if checksum else 0
    struct.pack_into("<Q", head, CHECKSUM_OFFSET, frame.checksum)
    return head, parts


# ---- the fast path (stagewise._C) and the public functions ------------------------------------

_STEP_KINDS = (None, *(StepKind(v) for v in range(1, len(StepKind) + 1)))
_LAYOUTS = (None, Layout.CONTIGUOUS)
_WIRE_DTYPES = (None, *(WireDType(v) for v in range(1, len(WireDType) + 1)))
"""Enum members by wire code (index 0: none), so the hot path makes no Enum lookups."""
_TORCH_DTYPES = (None, *(d.to_torch() for d in _WIRE_DTYPES[1:]))
_FRAME_FIELDS = ("step_kind", "request_id", "step_id", "microbatch", "stage_from", "stage_to", "token_index",
                 "layout", "rows", "tensors", "control", "batch", "seq", "hidden_size", "dtype", "payload_bytes",
                 "checksum")  # fmt: skip
assert tuple(f.name for f in dataclasses.fields(Frame))[: len(_FRAME_FIELDS)] == _FRAME_FIELDS  # positional Frame(...)
assert _C.frame_setup(
    Row, tuple(RowFlags(v) for v in range(_ROW_FLAG_BITS + 1)), torch.Tensor, {d.to_torch(): int(d) for d in WireDType},
    _WIRE_DTYPES, MAGIC,
) == {
    "header": HEADER.size, "row": ROW.size, "tensor": TENSOR.size, "align": ALIGN, "version": VERSION,
    "max_rows": MAX_ROWS, "max_tensors": MAX_TENSORS, "max_control": MAX_CONTROL_BYTES, "max_ndim": MAX_NDIM,
    "max_name": MAX_NAME_BYTES, "step_kinds": len(StepKind), "row_flag_bits": _ROW_FLAG_BITS, "magic": MAGIC,
}, "stagewise._C's frame fast path disagrees with codec.py: rebuild the extension"  # fmt: skip
assert len(Layout) == 1 and [int(d) for d in WireDType] == list(range(1, 11)) and _ROW_FLAG_BITS == 31
assert [d.itemsize for d in WireDType] == [4, 2, 2, 8, 8, 4, 2, 1, 1, 1]  # kItemsize in frame_py.cpp


def _head_fast(frame: Frame, checksum: bool) -> tuple[bytearray, list[tuple[int, int]]] | None:
    """(head with the checksum field 0, the tensors' (address, nbytes)) from the extension, or None
    (declined: a tensor that is not a contiguous CPU torch.Tensor, a field out of range...). Fills
    the frame's derived fields but ``checksum``."""
    if frame.control is None and frame.step_kind != StepKind.CONTROL and frame.step_kind != StepKind.HELLO:
        data = b""
    else:
        try:
            data = _control_bytes(frame)
        except (TypeError, ValueError):  # the reference raises it, after the checks that come first
            return None
    return _C.frame_head(frame, data, FLAG_CHECKSUM if checksum else 0)


def encode_parts(frame: Frame, *, checksum: bool = True) -> tuple[bytearray, list[memoryview | bytes]]:
    """The frame as (head, payload parts): ``head`` is the header, tables, control and padding
    (checksum filled in); the parts are the payload in order (tensor memory as memoryviews, zero
    padding as bytes). Concatenated they are :func:`encode_frame`'s bytes. Fills ``frame``'s
    derived fields."""
    fast = _head_fast(frame, checksum)
    if fast is None:
        return _encode_parts_reference(frame, checksum=checksum)
    head, sources = fast
    parts, offset = [], 0
    for t, (_, nbytes) in zip(frame.tensors.values(), sources):
        if offset % ALIGN:
            parts.append(_ZEROS[: ALIGN - offset % ALIGN])
            offset = _align(offset)
        if nbytes:
            parts.append(_tensor_bytes(t))
        offset += nbytes
    frame.checksum = _C.frame_fill(None, head, sources, checksum)  # also stored in head
    return head, parts


class PreparedFrame:
    """A frame encoded but for its tensor bytes: :func:`prepare_frame` sizes it, :meth:`write`
    puts it into a buffer of that size (a ring slot reserved for it) with one copy of each tensor."""

    __slots__ = ("frame", "nbytes", "_head", "_sources", "_parts", "_checksum")

    def __init__(self, frame: Frame, checksum: bool) -> None:
        self.frame, self._checksum = frame, checksum
        fast = _head_fast(frame, checksum)
        if fast is None:
            self._head, self._parts = _encode_parts_reference(frame, checksum=checksum)
            self._sources = None
            self.nbytes = len(self._head) + sum(len(p) if isinstance(p, bytes) else p.nbytes for p in self._parts)
        else:
            self._head, self._sources = fast
            self._parts = None
            self.nbytes = len(self._head) + self.frame.payload_bytes

    def write(self, out: memoryview) -> int:
        """Write the frame into ``out`` (writable, at least ``nbytes`` long); returns ``nbytes``.
        Sets ``frame.checksum``. The frame's tensors must not change in between."""
        if self._sources is not None:
            self.frame.checksum = _C.frame_fill(out, self._head, self._sources, self._checksum)
            return self.nbytes
        out[: len(self._head)] = self._head
        pos = len(self._head)
        for p in self._parts:
            n = len(p) if isinstance(p, bytes) else p.nbytes
            out[pos : pos + n] = p
            pos += n
        return pos


def prepare_frame(frame: Frame, *, checksum: bool = True) -> PreparedFrame:
    """Check and lay out the frame (raising what :func:`encode_parts` raises); ``.nbytes`` is its
    size, ``.write(buffer)`` writes it."""
    return PreparedFrame(frame, checksum)


def frame_nbytes(frame: Frame) -> int:
    """Bytes of the encoded frame (header, tables, control, padding and payload)."""
    return PreparedFrame(frame, False).nbytes


def encode_frame(frame: Frame, *, checksum: bool = True) -> bytes:
    head, parts = encode_parts(frame, checksum=checksum)
    return b"".join([head, *parts])


def encode_frame_into(frame: Frame, buffer, *, checksum: bool = True) -> int:
    """Write the frame into ``buffer`` (a writable bytes-like object, e.g. a ring slot) with one
    copy of each tensor; returns the bytes written. Raises ValueError if it does not fit."""
    prepared = PreparedFrame(frame, checksum)
    out = memoryview(buffer).cast("B")
    need = prepared.nbytes
    if out.readonly or out.nbytes < need:
        raise ValueError(f"stagewise.transport: encode_frame_into needs a writable buffer of at least {need} bytes, "
                         f"got {out.nbytes} ({'read-only' if out.readonly else 'writable'})")  # fmt: skip
    return prepared.write(out[:need])


def _as_bytes_view(buf) -> memoryview:
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.device.type != "cpu" or not buf.is_contiguous():
            raise TypeError(f"stagewise.transport: decode_frame takes bytes or a contiguous CPU uint8 tensor, got {buf.dtype} on {buf.device}")
        buf = buf.reshape(-1).numpy()
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


_readonly_warned = False
"""torch.frombuffer warns once per process about a read-only buffer; the first view is taken
with that warning silenced (the caller was told not to write the views)."""


def decode_frame(buf, *, verify_checksum: bool = True, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 copy: bool = True) -> Frame:  # fmt: skip
    """Parse and validate one whole frame; raise :class:`FrameError` naming the bad field.

    ``copy=False`` returns tensors that are views of ``buf`` (zero-copy: ``buf`` must stay alive
    and unchanged while they are used; views of a read-only buffer must not be written)."""
    global _readonly_warned
    mv = buf if type(buf) is memoryview and buf.ndim == 1 and buf.format == "B" else _as_bytes_view(buf)
    parsed = _C.frame_parse(mv, max_payload_bytes, verify_checksum)
    if parsed is None:  # some check failed (or an unusual argument): the reference raises the precise error
        return _decode_frame_reference(mv, verify_checksum, max_payload_bytes, copy)
    (kind, dtype, layout, flags, stage_from, stage_to, microbatch, request_id, step_id, batch, seq, hidden,
     token_index, payload_at, payload_bytes, checksum, rows, specs, control_at, control_len) = parsed  # fmt: skip
    control = _decode_control(mv[control_at : control_at + control_len]) if control_len else None
    tensors = {}
    for name, code, shape, at, numel in specs:
        if copy or numel == 0:
            tensors[name] = _tensor_from(mv, at, _WIRE_DTYPES[code], shape, copy)
            continue
        if mv.readonly and (not _readonly_warned or torch.is_warn_always_enabled()):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(mv, dtype=_TORCH_DTYPES[code], count=numel, offset=at)
            _readonly_warned = True
        else:
            t = torch.frombuffer(mv, dtype=_TORCH_DTYPES[code], count=numel, offset=at)
        tensors[name] = t if len(shape) == 1 else t.view(*shape) if shape else t.view(())
    return Frame(_STEP_KINDS[kind], request_id, step_id, microbatch, stage_from, stage_to, token_index,
                 _LAYOUTS[layout], rows, tensors, control, batch, seq, hidden, _WIRE_DTYPES[dtype], payload_bytes,
                 checksum)  # fmt: skip


def _decode_frame_reference(mv: memoryview, verify_checksum: bool, max_payload_bytes: int, copy: bool) -> Frame:
    """:func:`decode_frame` in plain Python: every check, in the documented order."""
    n = mv.nbytes
    if n < HEADER.size:
        raise FrameError("header", f"truncated: {n} bytes, the header alone has {HEADER.size}")
    (magic, version, kind, dtype, layout, flags, stage_from, stage_to, microbatch, request_id, step_id, batch, seq,
     hidden, token_index, num_rows, num_tensors, reserved0, control_len, reserved1, payload_bytes, checksum,
     ) = HEADER.unpack_from(mv, 0)  # fmt: skip
    if magic != MAGIC:
        raise FrameError("magic", f"expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != VERSION:
        raise FrameError("version", f"this side speaks version {VERSION}, the frame has version {version}")
    if kind not in StepKind._value2member_map_:
        raise FrameError("step_kind", f"unknown value {kind}; known: {', '.join(f'{k.value}={k.name}' for k in StepKind)}")
    if dtype != 0 and dtype not in WireDType._value2member_map_:
        raise FrameError("dtype", f"unknown value {dtype}; known: {', '.join(f'{d.value}={d.name}' for d in WireDType)}")
    if layout not in Layout._value2member_map_:
        raise FrameError("layout", f"unknown value {layout}; known: {', '.join(f'{x.value}={x.name}' for x in Layout)}")
    if flags & ~FLAG_CHECKSUM or reserved0 or reserved1:
        raise FrameError("frame_flags", f"unknown flag bits or nonzero reserved fields ({flags:#x}, {reserved0}, {reserved1})")
    if num_rows > MAX_ROWS:
        raise FrameError("num_rows", f"{num_rows} above the maximum {MAX_ROWS}")
    if num_tensors > MAX_TENSORS:
        raise FrameError("num_tensors", f"{num_tensors} above the maximum {MAX_TENSORS}")
    if control_len > MAX_CONTROL_BYTES:
        raise FrameError("control_bytes", f"{control_len} above the maximum {MAX_CONTROL_BYTES}")
    if payload_bytes > max_payload_bytes:
        raise FrameError("payload_bytes", f"{payload_bytes} above the maximum {max_payload_bytes} this receiver accepts")
    rows_at = HEADER.size
    tensors_at = rows_at + ROW.size * num_rows
    control_at = tensors_at + TENSOR.size * num_tensors
    payload_at = _align(control_at + control_len)
    total = payload_at + payload_bytes
    if n != total:
        what = "truncated" if n < total else "trailing bytes"
        raise FrameError("payload_bytes", f"{what}: the header describes a {total}-byte frame, got {n} bytes")
    if flags & FLAG_CHECKSUM:
        if verify_checksum:
            actual = xxh.digest([mv[:CHECKSUM_OFFSET], _ZEROS[:8], mv[HEADER.size : total]])
            if actual != checksum:
                raise FrameError("checksum", f"header says {checksum:#018x}, the frame hashes to {actual:#018x} (XXH3-64)")
    elif checksum:
        raise FrameError("checksum", f"{checksum:#018x} present without the checksum flag")

    rows = _decode_rows(mv[rows_at:tensors_at])
    specs = _decode_tensor_table(mv[tensors_at:control_at], payload_bytes)
    control = _decode_control(mv[control_at : control_at + control_len]) if control_len else None
    step_kind = StepKind(kind)
    if control is None and step_kind in (StepKind.CONTROL, StepKind.HELLO):
        raise FrameError("control", f"a {step_kind.name} frame needs a JSON object, got none")
    _check_shape_fields(specs, dtype, batch, seq, hidden)
    _check_rows_fit(rows, specs, batch, seq)
    tensors = {name: _tensor_from(mv, payload_at + off, d, shape, copy) for name, d, shape, off in specs}
    return Frame(
        step_kind=step_kind, request_id=request_id, step_id=step_id, microbatch=microbatch, stage_from=stage_from,
        stage_to=stage_to, token_index=token_index, layout=Layout(layout), rows=rows, tensors=tensors, control=control,
        batch=batch, seq=seq, hidden_size=hidden, dtype=WireDType(dtype) if dtype else None,
        payload_bytes=payload_bytes, checksum=checksum,
    )  # fmt: skip


def _decode_rows(mv: memoryview) -> list[Row]:
    rows, seen = [], set()
    for i, (rid, first, ntok, flags, reserved) in enumerate(ROW.iter_unpack(mv)):
        if flags & ~_ROW_FLAG_BITS or reserved:
            raise FrameError(f"rows[{i}].flags", f"unknown flag bits or nonzero reserved field ({flags:#x}, {reserved})")
        if rid in seen:
            raise FrameError(f"rows[{i}].request_id", f"request {rid} appears twice in the row table")
        seen.add(rid)
        rows.append(Row(request_id=rid, first_position=first, num_tokens=ntok, flags=RowFlags(flags)))
    return rows


def _decode_tensor_table(mv: memoryview, payload_bytes: int) -> list[tuple[str, WireDType, tuple[int, ...], int]]:
    specs, names, expect = [], set(), 0
    for i, (raw, dtype, ndim, r0, r1, offset, nbytes, *dims) in enumerate(TENSOR.iter_unpack(mv)):
        where = f"tensors[{i}]"
        name_bytes = raw.rstrip(b"\0")
        try:
            name = name_bytes.decode("utf-8")
        except UnicodeDecodeError:
            raise FrameError(f"{where}.name", f"not UTF-8: {name_bytes!r}") from None
        if not name or "\0" in name or name in names:
            raise FrameError(f"{where}.name", f"empty, NUL inside or duplicate: {name!r}")
        names.add(name)
        if dtype not in WireDType._value2member_map_:
            raise FrameError(f"{where}.dtype", f"unknown value {dtype} for tensor {name!r}")
        if ndim > MAX_NDIM or any(dims[ndim:]) or r0 or r1:
            raise FrameError(f"{where}.shape", f"ndim {ndim} with dims {dims} (at most {MAX_NDIM}; unused dims and reserved fields must be 0)")
        shape = tuple(dims[:ndim])
        want = math.prod(shape) * WireDType(dtype).itemsize
        if nbytes != want:
            raise FrameError(f"{where}.nbytes", f"tensor {name!r} of shape {shape} {WireDType(dtype).name} needs {want} bytes, table says {nbytes}")
        expect = _align(expect)
        if offset != expect or offset + nbytes > payload_bytes:
            raise FrameError(f"{where}.offset", f"tensor {name!r} at {offset} (+{nbytes} bytes); expected offset {expect} within payload_bytes {payload_bytes}")
        expect = offset + nbytes
        specs.append((name, WireDType(dtype), shape, offset))
    if expect != payload_bytes:
        raise FrameError("payload_bytes", f"header says {payload_bytes}, the tensor table ends at {expect}")
    return specs


def _decode_control(mv: memoryview) -> dict:
    try:
        value = json.loads(bytes(mv).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FrameError("control", f"not UTF-8 JSON: {type(e).__name__}: {str(e)[:120]}") from None
    if not isinstance(value, dict):
        raise FrameError("control", f"expected a JSON object, got {type(value).__name__}")
    return value


def _check_shape_fields(specs, dtype: int, batch: int, seq: int, hidden: int) -> None:
    if not specs:
        if dtype or batch or seq or hidden:
            raise FrameError("dtype", f"a frame without tensors must have dtype, batch, seq, hidden_size 0; got {dtype}, {batch}, {seq}, {hidden}")
        return
    name, d, shape, _ = specs[0]
    if dtype != d:
        raise FrameError("dtype", f"header says {WireDType(dtype).name if dtype else 0}, primary tensor {name!r} is {d.name}")
    for field, got, want in zip(("batch", "seq", "hidden_size"), (batch, seq, hidden), shape_fields(shape)):
        if got != want:
            raise FrameError(field, f"header says {got}, primary tensor {name!r} of shape {shape} gives {want}")


def _check_rows_fit(rows: list[Row], specs, batch: int, seq: int) -> None:
    """Rows either pack the primary tensor's batch * seq token slots exactly, or take one batch
    entry each with at most ``seq`` tokens (a padded batch)."""
    if not rows or not specs:
        return
    tokens = sum(r.num_tokens for r in rows)
    if tokens == batch * seq or (batch == len(rows) and max(r.num_tokens for r in rows) <= seq):
        return
    raise FrameError("rows", f"{len(rows)} rows with {tokens} tokens do not fit primary tensor {specs[0][0]!r} "
                             f"of shape {specs[0][2]} (packed: {batch * seq} tokens; padded: {batch} rows of <= {seq})")  # fmt: skip


def _tensor_from(mv: memoryview, at: int, dtype: WireDType, shape: tuple[int, ...], copy: bool) -> torch.Tensor:
    torch_dtype = dtype.to_torch()
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    nbytes = numel * dtype.itemsize
    if copy:
        out = torch.empty(shape, dtype=torch_dtype)
        memoryview(out.reshape(-1).view(torch.uint8).numpy())[:] = mv[at : at + nbytes]
        return out
    if mv.readonly:  # torch warns that the tensor could be written; the caller was told not to
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mv, dtype=torch_dtype, count=numel, offset=at).view(shape)
    return torch.frombuffer(mv, dtype=torch_dtype, count=numel, offset=at).view(shape)

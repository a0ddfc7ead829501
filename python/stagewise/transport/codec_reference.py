"""The frame codec in plain Python: the reference, for every frame and every error.

:mod:`stagewise.transport.codec` calls the extension's fast path first and comes here for
whatever it declines, so each error of ``docs/wire-format.md`` is raised by this module alone,
with one message. The struct formats and limits come from :mod:`stagewise.transport.wire` (the
extension's table); the checksum from the ``crc32c`` package, not from the extension, so that
the tests hold the C++ against an independent implementation.
"""

from __future__ import annotations

import json
import math
import warnings

import torch

from stagewise.transport import checksum as crc
from stagewise.transport import wire
from stagewise.transport.errors import FrameError
from stagewise.transport.frame import Frame, Layout, Row, RowFlags, StepKind, WireDType, shape_fields
from stagewise.transport.wire import HEADER, ROW, TENSOR, align

_U16, _U32, _U64 = (1 << 16) - 1, (1 << 32) - 1, (1 << 64) - 1
ZEROS = bytes(wire.ALIGN)


def check_range(name: str, value: int, top: int) -> None:
    if not isinstance(value, int) or not 0 <= value <= top:
        raise ValueError(f"stagewise.transport: Frame.{name} must be an integer in [0, {top}], got {value!r}")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, row-major: a view of its memory when it is a contiguous CPU tensor."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def control_bytes(frame: Frame) -> bytes:
    """The control section: compact UTF-8 JSON of ``frame.control`` (b"" for none)."""
    if frame.control is None:
        if frame.step_kind in (StepKind.CONTROL, StepKind.HELLO):
            raise ValueError(f"stagewise.transport: a {frame.step_kind.name} frame needs Frame.control (a dict)")
        return b""
    if not isinstance(frame.control, dict):
        raise TypeError(f"stagewise.transport: Frame.control must be a dict or None, got {type(frame.control).__name__}")
    data = json.dumps(frame.control, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    if len(data) > wire.MAX_CONTROL_BYTES:
        raise ValueError(f"stagewise.transport: Frame.control is {len(data)} bytes of JSON, above {wire.MAX_CONTROL_BYTES}")
    return data


def encode_parts(frame: Frame, *, checksum: bool = True, detached: bool = False) -> tuple[bytearray, list]:
    """(head, payload parts) of the frame: the header, tables, control and padding with the
    checksum filled in, then the tensors' bytes (memoryviews) and zero padding (bytes). With
    ``detached`` the frame is a descriptor: the head alone, its tensors' bytes not read (they may
    be on a GPU), no parts. Fills ``frame``'s derived fields."""
    check_range("request_id", frame.request_id, _U64)
    check_range("step_id", frame.step_id, _U64)
    for name in ("microbatch", "stage_from", "stage_to"):
        check_range(name, getattr(frame, name), _U16)
    check_range("token_index", frame.token_index, _U32)
    step_kind, layout = StepKind(frame.step_kind), Layout(frame.layout)
    if len(frame.rows) > wire.MAX_ROWS or len(frame.tensors) > wire.MAX_TENSORS:
        raise ValueError(f"stagewise.transport: a frame holds at most {wire.MAX_ROWS} rows and {wire.MAX_TENSORS} "
                         f"tensors, got {len(frame.rows)} and {len(frame.tensors)}")  # fmt: skip
    control = control_bytes(frame)

    entries, parts, offset = [], [], 0
    for name, t in frame.tensors.items():
        raw = name.encode() if isinstance(name, str) else b""
        if not 0 < len(raw) <= wire.MAX_NAME_BYTES or b"\0" in raw:
            raise ValueError(f"stagewise.transport: tensor name must be 1-{wire.MAX_NAME_BYTES} UTF-8 bytes without "
                             f"NUL, got {name!r}")  # fmt: skip
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"stagewise.transport: Frame.tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        dtype = WireDType.from_torch(t.dtype)
        if t.dim() > wire.MAX_NDIM or any(d > _U32 for d in t.shape):
            raise ValueError(f"stagewise.transport: Frame.tensors[{name!r}] has shape {tuple(t.shape)}; "
                             f"at most {wire.MAX_NDIM} dimensions of at most {_U32} each")  # fmt: skip
        nbytes = t.numel() * dtype.itemsize
        dims = list(t.shape) + [0] * (wire.MAX_NDIM - t.dim())
        if align(offset) > offset:
            parts.append(ZEROS[: align(offset) - offset])
            offset = align(offset)
        entries.append(TENSOR.pack(raw, dtype, t.dim(), 0, 0, offset, nbytes, *dims))
        if nbytes and not detached:
            parts.append(tensor_bytes(t))
        offset += nbytes

    primary = frame.primary
    if primary is None:
        frame.batch = frame.seq = frame.hidden_size = 0
        frame.dtype = None
    else:
        frame.batch, frame.seq, frame.hidden_size = shape_fields(tuple(primary.shape))
        frame.dtype = WireDType.from_torch(primary.dtype)
        for name in ("batch", "seq", "hidden_size"):
            check_range(name, getattr(frame, name), _U32)
    rows = []
    for i, r in enumerate(frame.rows):
        check_range(f"rows[{i}].request_id", r.request_id, _U64)
        check_range(f"rows[{i}].first_position", r.first_position, _U32)
        check_range(f"rows[{i}].num_tokens", r.num_tokens, _U32)
        rows.append(ROW.pack(r.request_id, r.first_position, r.num_tokens, int(r.flags), 0))
    frame.payload_bytes = offset
    frame.magic, frame.version = wire.MAGIC, wire.VERSION
    flags = (wire.FLAG_CHECKSUM if checksum else 0) | (wire.FLAG_DETACHED_PAYLOAD if detached else 0)

    head = bytearray(align(HEADER.size + ROW.size * len(rows) + TENSOR.size * len(entries) + len(control)))
    HEADER.pack_into(
        head, 0, wire.MAGIC, wire.VERSION, step_kind, 0 if frame.dtype is None else frame.dtype, layout, flags,
        frame.stage_from, frame.stage_to, frame.microbatch, frame.request_id, frame.step_id, frame.batch, frame.seq,
        frame.hidden_size, frame.token_index, len(rows), len(entries), 0, len(control), 0, offset, 0,
    )  # fmt: skip
    pos = HEADER.size
    for chunk in (*rows, *entries, control):
        head[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    if detached:
        parts = []  # and no padding either: the head is the whole frame
    frame.checksum = crc.reference_digest([head, *parts]) if checksum else 0
    head[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 8] = frame.checksum.to_bytes(8, "little")
    return head, parts


def decode(mv: memoryview, *, verify_checksum: bool = True, max_payload_bytes: int = wire.DEFAULT_MAX_PAYLOAD_BYTES,
           copy: bool = True, payload: torch.Tensor | None = None) -> Frame:  # fmt: skip
    """Parse and check one whole frame (a 1-D byte memoryview), every check in the documented
    order; raise :class:`FrameError` naming the field. ``payload``: the memory a descriptor
    frame's tensors lie in (a 1-D uint8 tensor); required for a descriptor, refused otherwise."""
    n = mv.nbytes
    if n < HEADER.size:
        raise FrameError("header", f"truncated: {n} bytes, the header alone has {HEADER.size}")
    h = wire.Header._make(HEADER.unpack_from(mv, 0))
    if h.magic != wire.MAGIC:
        raise FrameError("magic", f"expected {wire.MAGIC!r}, got {bytes(h.magic)!r}")
    if h.version != wire.VERSION:
        raise FrameError("version", f"this side speaks version {wire.VERSION}, the frame has version {h.version}")
    if h.step_kind not in StepKind._value2member_map_:
        known = ", ".join(f"{k.value}={k.name}" for k in StepKind)
        raise FrameError("step_kind", f"unknown value {h.step_kind}; known: {known}")
    if h.dtype != 0 and h.dtype not in WireDType._value2member_map_:
        known = ", ".join(f"{d.value}={d.name}" for d in WireDType)
        raise FrameError("dtype", f"unknown value {h.dtype}; known: {known}")
    if h.layout not in Layout._value2member_map_:
        raise FrameError("layout", f"unknown value {h.layout}; known: {', '.join(f'{x.value}={x.name}' for x in Layout)}")
    flags = h.frame_flags
    if flags & ~wire.FRAME_FLAG_BITS or h.reserved0 or h.reserved1:
        raise FrameError("frame_flags", f"unknown flag bits or nonzero reserved fields ({flags:#x}, {h.reserved0}, "
                                        f"{h.reserved1})")  # fmt: skip
    detached = bool(flags & wire.FLAG_DETACHED_PAYLOAD)
    if detached != (payload is not None):
        raise FrameError("frame_flags", "a descriptor frame (its tensors lie outside it) arrived where a whole frame "
                         "was expected" if detached else "a whole frame arrived where a descriptor was expected")
    if h.num_rows > wire.MAX_ROWS:
        raise FrameError("num_rows", f"{h.num_rows} above the maximum {wire.MAX_ROWS}")
    if h.num_tensors > wire.MAX_TENSORS:
        raise FrameError("num_tensors", f"{h.num_tensors} above the maximum {wire.MAX_TENSORS}")
    if h.control_bytes > wire.MAX_CONTROL_BYTES:
        raise FrameError("control_bytes", f"{h.control_bytes} above the maximum {wire.MAX_CONTROL_BYTES}")
    if h.payload_bytes > max_payload_bytes:
        raise FrameError("payload_bytes", f"{h.payload_bytes} above the maximum {max_payload_bytes} this receiver accepts")
    rows_at = HEADER.size
    tensors_at = rows_at + ROW.size * h.num_rows
    control_at = tensors_at + TENSOR.size * h.num_tensors
    payload_at = align(control_at + h.control_bytes)
    total = payload_at + (0 if detached else h.payload_bytes)
    if n != total:
        what = "truncated" if n < total else "trailing bytes"
        raise FrameError("payload_bytes", f"{what}: the header describes a {total}-byte frame, got {n} bytes")
    if detached and h.payload_bytes > payload.numel():
        raise FrameError("payload_bytes", f"the descriptor's tensors need {h.payload_bytes} bytes, the memory they "
                                          f"lie in has {payload.numel()}")  # fmt: skip
    _check_checksum(mv, h, verify_checksum)

    rows = _decode_rows(mv[rows_at:tensors_at])
    specs = _decode_tensor_table(mv[tensors_at:control_at], h.payload_bytes)
    control = decode_control(mv[control_at : control_at + h.control_bytes]) if h.control_bytes else None
    step_kind = StepKind(h.step_kind)
    if control is None and step_kind in (StepKind.CONTROL, StepKind.HELLO):
        raise FrameError("control", f"a {step_kind.name} frame needs a JSON object, got none")
    _check_shape_fields(specs, h.dtype, h.batch, h.seq, h.hidden_size)
    _check_rows_fit(rows, specs, h.batch, h.seq)
    if detached:
        tensors = {name: tensor_in(payload, off, d, shape, copy) for name, d, shape, off in specs}
    else:
        tensors = {name: tensor_from(mv, payload_at + off, d, shape, copy) for name, d, shape, off in specs}
    return Frame(
        step_kind=step_kind, request_id=h.request_id, step_id=h.step_id, microbatch=h.microbatch,
        stage_from=h.stage_from, stage_to=h.stage_to, token_index=h.token_index, layout=Layout(h.layout), rows=rows,
        tensors=tensors, control=control, batch=h.batch, seq=h.seq, hidden_size=h.hidden_size,
        dtype=WireDType(h.dtype) if h.dtype else None, payload_bytes=h.payload_bytes, checksum=h.checksum,
    )  # fmt: skip


def _check_checksum(mv: memoryview, h, verify: bool) -> None:
    if not h.frame_flags & wire.FLAG_CHECKSUM:
        if h.checksum:
            raise FrameError("checksum", f"{h.checksum:#018x} present without the checksum flag")
        return
    if h.checksum >> 32:
        raise FrameError("checksum", f"{h.checksum:#018x}: a CRC32C has 32 bits, the upper 32 must be zero")
    if verify:
        at = wire.CHECKSUM_OFFSET
        actual = crc.reference_digest([mv[:at], ZEROS[:8], mv[at + 8 :]])
        if actual != h.checksum:
            raise FrameError("checksum", f"header says {h.checksum:#010x}, the frame's CRC32C is {actual:#010x}")


def _decode_rows(mv: memoryview) -> list[Row]:
    rows, seen = [], set()
    for i, (rid, first, ntok, flags, reserved) in enumerate(ROW.iter_unpack(mv)):
        if flags & ~wire.ROW_FLAG_BITS or reserved:
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
        if ndim > wire.MAX_NDIM or any(dims[ndim:]) or r0 or r1:
            raise FrameError(f"{where}.shape", f"ndim {ndim} with dims {dims} (at most {wire.MAX_NDIM}; unused dims "
                                               "and reserved fields must be 0)")  # fmt: skip
        shape = tuple(dims[:ndim])
        want = math.prod(shape) * WireDType(dtype).itemsize
        if nbytes != want:
            raise FrameError(f"{where}.nbytes", f"tensor {name!r} of shape {shape} {WireDType(dtype).name} needs "
                                                f"{want} bytes, table says {nbytes}")  # fmt: skip
        expect = align(expect)
        if offset != expect or offset + nbytes > payload_bytes:
            raise FrameError(f"{where}.offset", f"tensor {name!r} at {offset} (+{nbytes} bytes); expected offset "
                                                f"{expect} within payload_bytes {payload_bytes}")  # fmt: skip
        expect = offset + nbytes
        specs.append((name, WireDType(dtype), shape, offset))
    if expect != payload_bytes:
        raise FrameError("payload_bytes", f"header says {payload_bytes}, the tensor table ends at {expect}")
    return specs


def decode_control(mv: memoryview) -> dict:
    """The control section as a JSON object, or FrameError("control")."""
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
            raise FrameError("dtype", f"a frame without tensors must have dtype, batch, seq, hidden_size 0; got "
                                      f"{dtype}, {batch}, {seq}, {hidden}")  # fmt: skip
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


def tensor_from(mv: memoryview, at: int, dtype: WireDType, shape: tuple[int, ...], copy: bool) -> torch.Tensor:
    """The tensor at byte ``at`` of a frame's buffer: a view of it, or with ``copy`` its own memory."""
    torch_dtype = dtype.to_torch()
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    if copy:
        out = torch.empty(shape, dtype=torch_dtype)
        memoryview(out.reshape(-1).view(torch.uint8).numpy())[:] = mv[at : at + numel * dtype.itemsize]
        return out
    if mv.readonly:  # torch warns that the tensor could be written; the caller was told not to
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mv, dtype=torch_dtype, count=numel, offset=at).view(shape)
    return torch.frombuffer(mv, dtype=torch_dtype, count=numel, offset=at).view(shape)


def tensor_in(payload: torch.Tensor, at: int, dtype: WireDType, shape: tuple[int, ...], copy: bool) -> torch.Tensor:
    """A descriptor's tensor at byte ``at`` of ``payload`` (a 1-D uint8 tensor on any device)."""
    torch_dtype = dtype.to_torch()
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype, device=payload.device)
    t = payload.narrow(0, at, numel * dtype.itemsize).view(torch_dtype).view(shape)
    return t.clone() if copy else t

"""Frame <-> bytes: the one codec. The byte table is ``docs/wire-format.md``; its constants are
:mod:`stagewise.transport.wire` (the extension's table).

Nothing here knows about sockets: the same bytes go over TCP, torch.distributed or a shared-memory
ring. :func:`encode_parts` gives the frame as a list of buffers (header and tables, then the
tensors' own memory), so that a sender can hand them to ``sendmsg`` or copy them into a ring slot
without building the frame in between; :func:`prepare_frame` sizes a frame and writes it into a
slot with one copy of each tensor; :func:`encode_descriptor` / ``decode_frame(payload=...)`` carry
a frame whose tensors lie in a ring slot of their own (the cuda-ipc ring).

Two implementations of one format: every function first tries the extension's fast path
(``stagewise._C.frame_head`` / ``frame_fill`` / ``frame_parse``; C++ in ``csrc/cpu/frame.cpp``),
which handles the frames of a running pipeline (contiguous CPU tensors, fields in range) and
*declines* anything else; a declined frame goes through :mod:`~stagewise.transport.codec_reference`,
which raises the precise error. A frame the fast path accepts is one the reference accepts, with
the same bytes or the same decoded frame (``tests/transport/test_codec_fast.py``).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from stagewise import _C
from stagewise.transport import codec_reference as reference
from stagewise.transport import wire
from stagewise.transport.frame import Frame, Layout, Row, RowFlags, StepKind, WireDType
from stagewise.transport.wire import ALIGN, DEFAULT_MAX_PAYLOAD_BYTES, FLAG_CHECKSUM, FLAG_DETACHED_PAYLOAD, align

_STEP_KINDS = (None, *StepKind)
_LAYOUTS = (None, Layout.CONTIGUOUS)
_WIRE_DTYPES = (None, *WireDType)
"""Enum members by wire code (index 0: none), so the hot path makes no Enum lookups."""
_TORCH_DTYPES = (None, *(d.to_torch() for d in WireDType))
_FRAME_FIELDS = ("step_kind", "request_id", "step_id", "microbatch", "stage_from", "stage_to", "token_index",
                 "layout", "rows", "tensors", "control", "batch", "seq", "hidden_size", "dtype", "payload_bytes",
                 "checksum")  # fmt: skip
if tuple(f.name for f in dataclasses.fields(Frame))[: len(_FRAME_FIELDS)] != _FRAME_FIELDS:
    raise ImportError("stagewise.transport.codec: Frame's fields moved; decode_frame builds it positionally")
_C.frame_setup(Row, tuple(RowFlags(v) for v in range(wire.ROW_FLAG_BITS + 1)), torch.Tensor,
               {d.to_torch(): int(d) for d in WireDType}, _WIRE_DTYPES)  # fmt: skip


def _flags(checksum: bool, detached: bool = False) -> int:
    return (FLAG_CHECKSUM if checksum else 0) | (FLAG_DETACHED_PAYLOAD if detached else 0)


def encode_fast(frame: Frame, *, checksum: bool = True, detached: bool = False):
    """The fast path alone: (head with the checksum field 0, the tensors' (address, nbytes)), or
    None when it declines (a tensor that is not a contiguous CPU torch.Tensor, a field out of
    range...). Fills the frame's derived fields but ``checksum``. With ``detached``, only the
    tensors' dtypes and shapes are read (addresses 0)."""
    return _head(frame, _flags(checksum, detached))


def _head(frame: Frame, flags: int):
    if frame.control is None and frame.step_kind != StepKind.CONTROL and frame.step_kind != StepKind.HELLO:
        data = b""
    else:
        try:
            data = reference.control_bytes(frame)
        except (TypeError, ValueError):  # the reference raises it, after the checks that come first
            return None
    return _C.frame_head(frame, data, flags)


def encode_parts(frame: Frame, *, checksum: bool = True) -> tuple[bytearray, list[memoryview | bytes]]:
    """The frame as (head, payload parts): ``head`` is the header, tables, control and padding
    (checksum filled in); the parts are the payload in order (tensor memory as memoryviews, zero
    padding as bytes). Concatenated they are :func:`encode_frame`'s bytes. Fills ``frame``'s
    derived fields."""
    fast = _head(frame, FLAG_CHECKSUM if checksum else 0)
    if fast is None:
        return reference.encode_parts(frame, checksum=checksum)
    head, sources = fast
    parts, offset = [], 0
    for t, (_, nbytes) in zip(frame.tensors.values(), sources):
        if offset % ALIGN:
            parts.append(reference.ZEROS[: ALIGN - offset % ALIGN])
            offset = align(offset)
        if nbytes:
            parts.append(reference.tensor_bytes(t))
        offset += nbytes
    frame.checksum = _C.frame_fill(None, head, sources, checksum)  # also stored in head
    return head, parts


def encode_descriptor(frame: Frame, *, checksum: bool = True) -> tuple[bytearray, list[tuple[int, int]]]:
    """A descriptor of the frame: its header, tables and control (the checksum covers them),
    flagged as having its payload elsewhere; and per tensor (offset, nbytes) where its bytes
    go in that payload (64-aligned, in order; ``frame.payload_bytes`` is the extent). The
    tensors' bytes are not read: they may be on a GPU. Fills ``frame``'s derived fields."""
    fast = encode_fast(frame, checksum=checksum, detached=True)
    if fast is None:
        head = reference.encode_parts(frame, checksum=checksum, detached=True)[0]
        sizes = [t.numel() * WireDType.from_torch(t.dtype).itemsize for t in frame.tensors.values()]
    else:
        head, sources = fast
        sizes = [nbytes for _, nbytes in sources]
        frame.checksum = _C.frame_fill(None, head, [], checksum)
    spans, offset = [], 0
    for nbytes in sizes:
        offset = align(offset)
        spans.append((offset, nbytes))
        offset += nbytes
    return head, spans


def is_descriptor(buf) -> bool:
    """Whether the bytes begin a descriptor frame (checked no further: decode it to check)."""
    mv = _as_bytes_view(buf)
    at = wire.HEADER_OFFSETS["frame_flags"]
    return mv.nbytes > at and mv[:4] == wire.MAGIC and bool(mv[at] & FLAG_DETACHED_PAYLOAD)


class PreparedFrame:
    """A frame encoded but for its tensor bytes: :func:`prepare_frame` sizes it, :meth:`write`
    puts it into a buffer of that size (a ring slot reserved for it) with one copy of each tensor."""

    __slots__ = ("frame", "nbytes", "_head", "_sources", "_parts", "_checksum")

    def __init__(self, frame: Frame, checksum: bool) -> None:
        self.frame, self._checksum = frame, checksum
        fast = _head(frame, FLAG_CHECKSUM if checksum else 0)
        if fast is None:
            self._head, self._parts = reference.encode_parts(frame, checksum=checksum)
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


# ---- decoding ----------------------------------------------------------------------------------


def _as_bytes_view(buf) -> memoryview:
    if type(buf) is memoryview and buf.ndim == 1 and buf.itemsize == 1:
        return buf
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.device.type != "cpu" or not buf.is_contiguous():
            raise TypeError(f"stagewise.transport: decode_frame takes bytes or a contiguous CPU uint8 tensor, got "
                            f"{buf.dtype} on {buf.device}")  # fmt: skip
        buf = buf.reshape(-1).numpy()
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _check_payload(payload) -> None:
    if payload is not None and (not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8
                                or payload.dim() != 1 or not payload.is_contiguous()):  # fmt: skip
        raise TypeError(f"stagewise.transport: decode_frame's payload must be a contiguous 1-D uint8 tensor, got "
                        f"{type(payload).__name__} {getattr(payload, 'dtype', '')}")  # fmt: skip


_readonly_warned = False
"""torch.frombuffer warns once per process about a read-only buffer; the first view is taken
with that warning silenced (the caller was told not to write the views)."""


def decode_frame(buf, *, verify_checksum: bool = True, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 copy: bool = True, payload: torch.Tensor | None = None) -> Frame:  # fmt: skip
    """Parse and validate one whole frame; raise :class:`FrameError` naming the bad field.

    ``copy=False`` returns tensors that are views of ``buf`` (zero-copy: ``buf`` must stay alive
    and unchanged while they are used; views of a read-only buffer must not be written).
    ``payload``: for a descriptor frame (:func:`encode_descriptor`), the memory its tensors lie
    in, a 1-D uint8 tensor on any device (a ring slot); the tensors are views of it unless
    ``copy``. A descriptor without ``payload``, or ``payload`` with a whole frame, is refused."""
    global _readonly_warned
    # The fast path inline (this runs once per frame on every link; a call costs ~0.1 us here).
    mv = buf if type(buf) is memoryview and buf.ndim == 1 and buf.itemsize == 1 else _as_bytes_view(buf)
    if payload is not None:
        _check_payload(payload)
    parsed = _C.frame_parse(mv, max_payload_bytes, verify_checksum)
    if parsed is None:  # some check failed (or an unusual argument): the reference raises the precise error
        return _reference_decode(mv, verify_checksum, max_payload_bytes, copy, payload)
    (kind, dtype, layout, flags, stage_from, stage_to, microbatch, request_id, step_id, batch, seq, hidden,
     token_index, payload_at, payload_bytes, checksum, rows, specs, control_at, control_len) = parsed  # fmt: skip
    detached = flags & FLAG_DETACHED_PAYLOAD
    if detached or payload is not None:
        if not detached or payload is None or payload_bytes > payload.numel():
            return _reference_decode(mv, verify_checksum, max_payload_bytes, copy, payload)
    control = _control(mv[control_at : control_at + control_len]) if control_len else None
    if control is _BAD_CONTROL:
        return _reference_decode(mv, verify_checksum, max_payload_bytes, copy, payload)
    tensors = {}
    for name, code, shape, offset, numel in specs:
        if detached:
            tensors[name] = reference.tensor_in(payload, offset, _WIRE_DTYPES[code], shape, copy)
            continue
        if copy or numel == 0:
            tensors[name] = reference.tensor_from(mv, payload_at + offset, _WIRE_DTYPES[code], shape, copy)
            continue
        if mv.readonly and (not _readonly_warned or torch.is_warn_always_enabled()):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(mv, dtype=_TORCH_DTYPES[code], count=numel, offset=payload_at + offset)
            _readonly_warned = True
        else:
            t = torch.frombuffer(mv, dtype=_TORCH_DTYPES[code], count=numel, offset=payload_at + offset)
        tensors[name] = t if len(shape) == 1 else t.view(*shape) if shape else t.view(())
    return Frame(_STEP_KINDS[kind], request_id, step_id, microbatch, stage_from, stage_to, token_index,
                 _LAYOUTS[layout], rows, tensors, control, batch, seq, hidden, _WIRE_DTYPES[dtype], payload_bytes,
                 checksum)  # fmt: skip


_BAD_CONTROL = object()


def _control(mv: memoryview):
    """The control JSON, or _BAD_CONTROL (the reference names the error, after the checks before it)."""
    try:
        return reference.decode_control(mv)
    except ValueError:
        return _BAD_CONTROL


def _reference_decode(mv: memoryview, verify_checksum: bool, max_payload_bytes: int, copy: bool, payload) -> Frame:
    return reference.decode(mv, verify_checksum=verify_checksum, max_payload_bytes=max_payload_bytes, copy=copy,
                            payload=payload)  # fmt: skip

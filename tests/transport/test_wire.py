"""The frame codec: golden bytes written from docs/wire-format.md's table with struct (not by the
encoder), round trips for every dtype and step kind, zero-copy decode, and every class of
malformed frame rejected with a FrameError that names the field."""

from __future__ import annotations

import json
import struct

import crc32c
import pytest
import torch

import stagewise
from stagewise.transport import (
    Frame, FrameError, Row, RowFlags, StepKind, WireDType, decode_frame, encode_frame, encode_frame_into, frame_nbytes,
)  # fmt: skip

# The documented layout (docs/wire-format.md), written out independently of the codec.
HDR = "<4sHBBBBHHHQQIIIIIHHIIQQ"  # 80 bytes
ROW = "<QIIII"  # 24 bytes
TENSOR = "<24sBBHIQQ8I"  # 80 bytes
DT = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.int64: 5, torch.int32: 6,
      torch.int16: 7, torch.int8: 8, torch.uint8: 9, torch.bool: 10}  # fmt: skip


def pad64(b: bytes) -> bytes:
    return b + bytes(-len(b) % 64)


def seal(buf: bytes) -> bytes:
    """Set flag bit 0 and the CRC32C of the frame with its checksum field zeroed (in the field's low 32 bits)."""
    b = bytearray(buf)
    b[9] |= 1
    b[72:80] = bytes(8)
    b[72:80] = struct.pack("<Q", crc32c.crc32c(bytes(b)))
    return bytes(b)


def golden_frame() -> Frame:
    return Frame(
        step_kind=StepKind.MIXED, request_id=0x0102030405060708, step_id=9, microbatch=2, stage_from=1, stage_to=2,
        token_index=17, rows=[Row(11, 0, 3, RowFlags.PREFILL | RowFlags.LAST_PREFILL_CHUNK), Row(12, 40, 1)],
        tensors={"hidden": torch.arange(8, dtype=torch.float16).reshape(1, 4, 2), "positions": torch.tensor([0, 1, 2, 40])},
        control={"k": 1},
    )  # fmt: skip


def golden_bytes(checksum: bool) -> bytes:
    hidden = torch.arange(8, dtype=torch.float16).numpy().tobytes()  # 16 bytes at payload offset 0
    positions = struct.pack("<4q", 0, 1, 2, 40)  # 32 bytes at payload offset 64
    control = b'{"k":1}'
    header = struct.pack(HDR, b"SWFR", 2, 3, 2, 1, 0, 1, 2, 2, 0x0102030405060708, 9, 1, 4, 2, 17, 2, 2, 0,
                         len(control), 0, 64 + 32, 0)  # fmt: skip
    rows = struct.pack(ROW, 11, 0, 3, 1 | 2, 0) + struct.pack(ROW, 12, 40, 1, 0, 0)
    t0 = struct.pack(TENSOR, b"hidden", 2, 3, 0, 0, 0, 16, 1, 4, 2, 0, 0, 0, 0, 0)
    t1 = struct.pack(TENSOR, b"positions", 5, 1, 0, 0, 64, 32, 4, 0, 0, 0, 0, 0, 0, 0)
    raw = pad64(header + rows + t0 + t1 + control) + pad64(hidden) + positions
    return seal(raw) if checksum else raw


@pytest.mark.parametrize("checksum", [True, False])
def test_golden_bytes(checksum):
    expected = golden_bytes(checksum)
    assert len(expected) == 416
    assert encode_frame(golden_frame(), checksum=checksum) == expected
    f = decode_frame(expected)
    assert (f.step_kind, f.request_id, f.step_id, f.microbatch, f.stage_from, f.stage_to, f.token_index) == (
        StepKind.MIXED, 0x0102030405060708, 9, 2, 1, 2, 17)
    assert (f.batch, f.seq, f.hidden_size, f.dtype, f.payload_bytes) == (1, 4, 2, WireDType.FLOAT16, 96)
    assert f.rows == [Row(11, 0, 3, RowFlags.PREFILL | RowFlags.LAST_PREFILL_CHUNK), Row(12, 40, 1)]
    assert list(f.tensors) == ["hidden", "positions"] and f.control == {"k": 1}
    assert torch.equal(f.tensors["positions"], torch.tensor([0, 1, 2, 40]))


def test_golden_control_frame_without_tensors():
    control = json.dumps({"op": "cancel", "request_id": 5}, separators=(",", ":")).encode()
    header = struct.pack(HDR, b"SWFR", 2, 6, 0, 1, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, len(control), 0, 0, 0)
    expected = seal(pad64(header + control))
    frame = Frame(step_kind=StepKind.CONTROL, request_id=5, control={"op": "cancel", "request_id": 5})
    assert encode_frame(frame) == expected and frame_nbytes(frame) == len(expected) == 128


def _values(dtype: torch.dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", list(DT), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", [k for k in StepKind], ids=lambda k: k.name)
def test_round_trip_every_dtype_and_step_kind(dtype, kind):
    tensors = {"hidden": _values(dtype, (3, 5, 7)), "extra": _values(dtype, (2, 3, 1, 2, 1))}
    frame = Frame(step_kind=kind, request_id=2**64 - 1, step_id=2**63, stage_from=65535, tensors=tensors,
                  control={"kind": kind.name, "nested": [1, 2.5, None, "ü"]})  # fmt: skip
    data = encode_frame(frame)
    assert len(data) == frame_nbytes(frame)
    for copy in (True, False):
        out = decode_frame(data, copy=copy)
        assert out.step_kind == kind and out.request_id == 2**64 - 1 and out.step_id == 2**63
        assert (out.batch, out.seq, out.hidden_size) == (3, 5, 7) and out.dtype.to_torch() == dtype
        assert out.control == frame.control
        for name, t in tensors.items():
            assert out.tensors[name].dtype == dtype and torch.equal(out.tensors[name], t)


@pytest.mark.parametrize("shape,fields", [((), (1, 1, 1)), ((6,), (6, 1, 1)), ((5, 9), (1, 5, 9)),
                                          ((2, 3, 4, 8), (6, 4, 8)), ((0, 4), (1, 0, 4))])  # fmt: skip
def test_shape_fields_from_the_primary_tensor(shape, fields):
    out = decode_frame(encode_frame(Frame(step_kind=StepKind.TOKENS, tensors={"t": torch.zeros(shape, dtype=torch.int32)})))
    assert (out.batch, out.seq, out.hidden_size) == fields and out.tensors["t"].shape == shape


def test_copy_false_gives_views_of_the_buffer_and_encode_into_a_slot():
    frame = Frame(step_kind=StepKind.DECODE, tensors={"hidden": torch.randn(2, 1, 64), "residual": torch.randn(2, 1, 64)})
    slot = bytearray(frame_nbytes(frame) + 100)
    n = encode_frame_into(frame, slot)
    assert n == frame_nbytes(frame) and bytes(slot[:n]) == encode_frame(frame)
    view = decode_frame(memoryview(slot)[:n], copy=False)
    view.tensors["residual"][0, 0, 0] = 123.0  # writes through to the slot
    assert decode_frame(bytes(slot[:n]), verify_checksum=False).tensors["residual"][0, 0, 0] == 123.0
    owned = decode_frame(memoryview(slot)[:n], verify_checksum=False)
    slot[:n] = bytes(n)
    assert owned.tensors["residual"][0, 0, 0] == 123.0  # copy=True owns its memory
    with pytest.raises(ValueError, match="at least"):
        encode_frame_into(frame, bytearray(n - 1))


def test_noncontiguous_tensor_is_sent_row_major():
    t = torch.arange(12.0).reshape(3, 4).t()
    out = decode_frame(encode_frame(Frame(step_kind=StepKind.PREFILL, tensors={"hidden": t})))
    assert torch.equal(out.tensors["hidden"], t)


def test_encode_rejects_bad_frames():
    with pytest.raises(TypeError, match="complex64"):
        encode_frame(Frame(step_kind=StepKind.DECODE, tensors={"hidden": torch.zeros(2, dtype=torch.complex64)}))
    with pytest.raises(ValueError, match="name"):
        encode_frame(Frame(step_kind=StepKind.DECODE, tensors={"x" * 25: torch.zeros(2)}))
    with pytest.raises(ValueError, match="stage_to"):
        encode_frame(Frame(step_kind=StepKind.DECODE, stage_to=70000))
    with pytest.raises(ValueError, match="control"):
        encode_frame(Frame(step_kind=StepKind.CONTROL))
    with pytest.raises(ValueError):
        encode_frame(Frame(step_kind=StepKind.CONTROL, control={"x": float("nan")}))


def patch(buf: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(buf)
    struct.pack_into(fmt, b, offset, value)
    return seal(bytes(b))


# Offsets in the golden frame: header 0, rows 80 and 104, tensor entries 128 and 208, control 288,
# payload 320 (hidden, 16 bytes) and 384 (positions, 32 bytes); 416 bytes in all.
BAD = {
    "magic": lambda g: patch(g, 0, "<4s", b"XXXX"),
    "version": lambda g: patch(g, 4, "<H", 1),
    "step_kind": lambda g: patch(g, 6, "<B", 99),
    "dtype": lambda g: patch(g, 7, "<B", 77),
    "layout": lambda g: patch(g, 8, "<B", 5),
    "checksum": lambda g: g[:330] + bytes([g[330] ^ 1]) + g[331:],
    "header": lambda g: g[:50],
    "payload_bytes": lambda g: g[:-1],  # truncated inside the payload
    "batch": lambda g: patch(g, 32, "<I", 2),
    "seq": lambda g: patch(g, 36, "<I", 5),
    "hidden_size": lambda g: patch(g, 40, "<I", 3),
    "rows": lambda g: patch(g, 80 + 12, "<I", 7),  # row 0 claims 7 tokens: 8 in all, the tensor has 4 slots
    "rows[1].request_id": lambda g: patch(g, 104, "<Q", 11),
    "rows[0].flags": lambda g: patch(g, 80 + 16, "<I", 1 << 20),
    "tensors[0].dtype": lambda g: patch(g, 128 + 24, "<B", 66),
    "tensors[0].shape": lambda g: patch(g, 128 + 25, "<B", 9),
    "tensors[0].nbytes": lambda g: patch(g, 128 + 40, "<Q", 18),
    "tensors[1].offset": lambda g: patch(g, 208 + 32, "<Q", 16),
    "tensors[1].name": lambda g: patch(g, 208, "<24s", b"hidden"),
    "control": lambda g: patch(g, 288, "<7s", b'{"k":1,'),
    "frame_flags": lambda g: patch(g, 9, "<B", 1 | 4),
}


def test_golden_crc32c_check_value():
    """The checksum is the standard CRC32C (check value of b"123456789"), not just some CRC."""
    assert crc32c.crc32c(b"123456789") == 0xE3069283
    frame = golden_bytes(checksum=True)
    zeroed = frame[:72] + bytes(8) + frame[80:]
    assert struct.unpack_from("<Q", frame, 72)[0] == crc32c.crc32c(zeroed) < 1 << 32


def test_checksum_upper_bits_must_be_zero():
    sealed = bytearray(golden_bytes(checksum=True))
    sealed[76] = 1  # bit 32 of the field: the CRC itself still matches its low 32 bits
    with pytest.raises(FrameError, match="upper 32 must be zero") as err:
        decode_frame(bytes(sealed))
    assert err.value.field == "checksum"
    with pytest.raises(FrameError, match="upper 32 must be zero"):
        decode_frame(bytes(sealed), verify_checksum=False)


def test_version_1_frames_are_refused_naming_both_versions():
    old = patch(golden_bytes(checksum=True), 4, "<H", 1)
    with pytest.raises(FrameError, match="this side speaks version 2, the frame has version 1") as err:
        decode_frame(old)
    assert err.value.field == "version"


@pytest.mark.parametrize("field", list(BAD))
def test_malformed_frame_names_the_field(field):
    bad = BAD[field](golden_bytes(checksum=True))
    with pytest.raises(FrameError) as err:
        decode_frame(bad)
    assert err.value.field == field, str(err.value)
    assert field.split("[")[0] in str(err.value)
    assert isinstance(err.value, stagewise.FrameError)


def test_payload_above_the_maximum_and_trailing_bytes():
    good = golden_bytes(checksum=True)
    with pytest.raises(FrameError, match="payload_bytes: 96 above the maximum 64"):
        decode_frame(good, max_payload_bytes=64)
    with pytest.raises(FrameError, match="trailing bytes"):
        decode_frame(good + b"\0")


def test_checksum_off_per_run_and_control_frames_need_json():
    raw = golden_bytes(checksum=False)
    flipped = raw[:330] + bytes([raw[330] ^ 1]) + raw[331:]
    assert decode_frame(flipped).tensors["hidden"].flatten()[5] != 5  # no checksum in the frame: accepted
    sealed = golden_bytes(checksum=True)
    corrupt = sealed[:330] + bytes([sealed[330] ^ 1]) + sealed[331:]
    assert decode_frame(corrupt, verify_checksum=False).tensors["hidden"].flatten()[5] != 5
    with pytest.raises(FrameError) as err:
        decode_frame(patch(raw, 72, "<Q", 1)[:9] + bytes([0]) + patch(raw, 72, "<Q", 1)[10:])
    assert err.value.field == "checksum"
    header = struct.pack(HDR, b"SWFR", 2, 6, 0, 1, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(FrameError) as err:
        decode_frame(seal(pad64(header)))
    assert err.value.field == "control"

"""The codec's fast path (stagewise._C.frame_*) against the plain-Python reference (codec_reference).

The fast path may decline a frame (the reference then decides), but what it accepts it must accept
exactly as the reference does: the same bytes when encoding, the same frame when decoding, and for
a malformed frame the same FrameError (field and message). Fuzzed frames: byte flips anywhere in
the header and tables (resealed, so that the checksum does not hide the other checks, and not),
truncations and extensions, over frames of every kind; random frames to encode.
"""

from __future__ import annotations

import random
import struct

import crc32c
import pytest
import torch

from stagewise import _C
from stagewise.transport import Frame, FrameError, Row, RowFlags, StepKind, codec, codec_reference, decode_frame
from stagewise.transport import encode_frame
from stagewise.transport.frame import DEFAULT_MAX_PAYLOAD_BYTES, shape_fields

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]  # fmt: skip


def reseal(buf: bytes) -> bytes:
    """Recompute the checksum (docs/wire-format.md) when the frame says it carries one."""
    b = bytearray(buf)
    if len(b) >= 80 and b[9] & 1:
        b[72:80] = bytes(8)
        b[72:80] = struct.pack("<Q", crc32c.crc32c(bytes(b)))
    return bytes(b)


def sample_frames() -> list[Frame]:
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 1, 16, generator=g).to(torch.bfloat16)
    return [
        Frame(step_kind=StepKind.DECODE, step_id=7, token_index=12, tensors={"hidden": hidden},
              rows=[Row(5, 10, 1), Row(6, 3, 1, RowFlags.FINISHED), Row(9, 0, 1)]),
        Frame(step_kind=StepKind.MIXED, rows=[Row(1, 0, 3, RowFlags.PREFILL | RowFlags.LAST_PREFILL_CHUNK), Row(2, 8, 1)],
              tensors={"hidden": torch.randn(1, 4, 8, generator=g), "residual": torch.randn(1, 4, 8, generator=g),
                       "positions": torch.tensor([0, 1, 2, 8])}, control={"k": [1, "two"]}),
        Frame(step_kind=StepKind.PREFILL, rows=[Row(3, 0, 2), Row(4, 0, 1)], tensors={"hidden": torch.zeros(2, 2, 4)}),
        Frame(step_kind=StepKind.TOKENS, tensors={"token_ids": torch.tensor([5, 9, 2], dtype=torch.int64)}),
        Frame(step_kind=StepKind.CONTROL, request_id=77, control={"op": "cancel", "request_id": 77}),
        Frame(step_kind=StepKind.HEARTBEAT),
        Frame(step_kind=StepKind.KV_HANDOFF, request_id=3,
              tensors={"k": torch.randn(2, 1, 4, 2, 3, generator=g).half(), "scalar": torch.tensor(1.5),
                       "empty": torch.zeros(0, 5, dtype=torch.int8), "mask": torch.tensor([True, False])}),
    ]  # fmt: skip


def summary(frame: Frame) -> tuple:
    tensors = tuple((n, t.dtype, tuple(t.shape), t.reshape(-1).clone().view(torch.uint8).tolist())
                    for n, t in frame.tensors.items())  # fmt: skip
    rows = tuple((r.request_id, r.first_position, r.num_tokens, r.flags, type(r.flags)) for r in frame.rows)
    return (frame.step_kind, type(frame.step_kind), frame.request_id, frame.step_id, frame.microbatch,
            frame.stage_from, frame.stage_to, frame.token_index, frame.layout, type(frame.layout), rows, tensors,
            frame.control, frame.batch, frame.seq, frame.hidden_size, frame.dtype, frame.payload_bytes,
            frame.checksum, frame.magic, frame.version)  # fmt: skip


def outcome(fn) -> tuple:
    try:
        return ("ok", summary(fn()))
    except FrameError as e:
        return ("FrameError", e.field, str(e))


def reference_decode(buf: bytes, verify: bool, limit: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Frame:
    return codec_reference.decode(memoryview(buf), verify_checksum=verify, max_payload_bytes=limit)


def test_the_fast_path_takes_well_formed_frames():
    for frame in sample_frames():
        for check in (True, False):
            data = encode_frame(frame, checksum=check)
            assert codec.encode_fast(frame, checksum=check) is not None
            assert _C.frame_parse(memoryview(data), DEFAULT_MAX_PAYLOAD_BYTES, True) is not None
            assert outcome(lambda: decode_frame(data)) == outcome(lambda: reference_decode(data, True))


def test_fuzzed_frames_decode_as_the_reference_decodes():
    rng = random.Random(0)
    accepted = rejected = 0
    for frame in sample_frames():
        good = encode_frame(frame, checksum=rng.random() < 0.8)
        head_len = len(good) - frame.payload_bytes
        for _ in range(250):
            b = bytearray(good)
            what = rng.random()
            if what < 0.75:  # flip bits in the header, tables or control, mostly keeping the checksum right
                for _ in range(rng.choice([1, 1, 2, 3])):
                    at = rng.randrange(head_len) if rng.random() < 0.9 else rng.randrange(len(b))
                    b[at] ^= 1 << rng.randrange(8) if rng.random() < 0.7 else rng.randrange(1, 256)
                buf = reseal(bytes(b)) if rng.random() < 0.85 else bytes(b)
            elif what < 0.85:
                buf = bytes(b[: rng.randrange(len(b))])
            elif what < 0.92:
                buf = bytes(b) + bytes(rng.randrange(1, 130))
            else:  # a plausible field value written over a field
                off, fmt = rng.choice([(32, "<I"), (36, "<I"), (40, "<I"), (48, "<I"), (52, "<H"), (56, "<I"),
                                       (64, "<Q"), (7, "<B"), (6, "<B"), (9, "<B")])  # fmt: skip
                struct.pack_into(fmt, b, off, rng.choice([0, 1, 2, 3, 4, 7, 8, 64, 65, 255, 2**16 - 1]) % (256 if fmt == "<B" else 2**16))
                buf = reseal(bytes(b))
            for verify in (True, False):
                limit = rng.choice([DEFAULT_MAX_PAYLOAD_BYTES, frame.payload_bytes, max(0, frame.payload_bytes - 1)])
                fast = outcome(lambda: decode_frame(buf, verify_checksum=verify, max_payload_bytes=limit))
                ref = outcome(lambda: reference_decode(buf, verify, limit))
                assert fast == ref, (frame.step_kind, buf.hex())
                accepted += fast[0] == "ok"
                rejected += fast[0] != "ok"
    assert accepted > 300 and rejected > 1000  # both outcomes well exercised


def test_views_and_copies_from_the_fast_path():
    frame = sample_frames()[1]
    data = bytearray(encode_frame(frame))
    view = decode_frame(memoryview(data), copy=False)
    assert view.tensors["hidden"].data_ptr() == torch.frombuffer(data, dtype=torch.uint8).data_ptr() + len(data) - frame.payload_bytes
    owned = decode_frame(memoryview(data))
    data[-frame.payload_bytes :] = bytes(frame.payload_bytes)
    assert torch.equal(view.tensors["hidden"], torch.zeros(1, 4, 8))
    assert torch.equal(owned.tensors["hidden"], frame.tensors["hidden"])


def random_frame(rng: random.Random) -> Frame:
    tensors = {}
    for i in range(rng.choice([0, 1, 1, 2, 3])):
        dtype = rng.choice(DTYPES)
        ndim = rng.choice([0, 1, 2, 3, 3, 4, 8])
        shape = tuple(rng.choice([0, 1, 2]) if rng.random() < 0.1 else rng.randint(1, 6 if ndim <= 3 else 2)
                      for _ in range(ndim))  # fmt: skip
        t = (torch.rand(shape) * 100).to(dtype)
        tensors[rng.choice(["hidden", "residual", "x", "ü" * 11, "k", "v"]) + str(i)] = t
    rows = []
    if tensors and rng.random() < 0.7:
        batch, seq, _ = shape_fields(tuple(next(iter(tensors.values())).shape))
        rows = [Row(rng.randrange(2**64), rng.randrange(2**32), rng.randrange(seq + 1), RowFlags(rng.randrange(32)))
                for _ in range(min(batch, 40))]  # fmt: skip
    kind = rng.choice(list(StepKind))
    control = {"n": rng.randrange(100), "s": "é"} if kind in (StepKind.CONTROL, StepKind.HELLO) or rng.random() < 0.2 else None
    return Frame(step_kind=kind, request_id=rng.randrange(2**64), step_id=rng.randrange(2**64),
                 microbatch=rng.randrange(2**16), stage_from=rng.randrange(2**16), stage_to=rng.randrange(2**16),
                 token_index=rng.randrange(2**32), rows=rows, tensors=tensors, control=control)  # fmt: skip


def test_random_frames_encode_as_the_reference_encodes():
    rng = random.Random(1)
    for _ in range(300):
        frame = random_frame(rng)
        check = rng.random() < 0.5
        assert codec.encode_fast(frame, checksum=check) is not None
        head, parts = codec.encode_parts(frame, checksum=check)
        fast = bytes(head) + b"".join(bytes(p) for p in parts)
        fields = summary(frame)
        ref_head, ref_parts = codec_reference.encode_parts(frame, checksum=check)
        assert fast == bytes(ref_head) + b"".join(bytes(p) for p in ref_parts)
        assert summary(frame) == fields  # the derived fields (batch, dtype, checksum...) alike
        prepared = codec.prepare_frame(frame, checksum=check)
        slot = bytearray(rng.choice([b"\xff", b"\0"]) * (prepared.nbytes + 64))  # stale bytes must not leak
        assert prepared.write(memoryview(slot)[: prepared.nbytes]) == prepared.nbytes == len(fast)
        assert bytes(slot[: prepared.nbytes]) == fast
        assert outcome(lambda: decode_frame(fast)) == outcome(lambda: reference_decode(fast, True))


def test_frames_the_fast_path_declines_still_encode_or_fail_alike():
    t = torch.arange(12.0).reshape(3, 4)
    declined = [
        Frame(step_kind=StepKind.PREFILL, tensors={"hidden": t.t()}),  # not contiguous
        Frame(step_kind=StepKind.PREFILL, tensors={"hidden": torch.nn.Parameter(t)}),  # a subclass
        Frame(step_kind=StepKind.DECODE, tensors={"hidden": t}, rows=[Row(1, 2, 3, 2**33)]),
        Frame(step_kind=StepKind.DECODE, stage_to=70000),
        Frame(step_kind=StepKind.DECODE, request_id=-1),
        Frame(step_kind=StepKind.DECODE, token_index=1.0),
        Frame(step_kind=9),
        Frame(step_kind=StepKind.CONTROL),
        Frame(step_kind=StepKind.CONTROL, control=[1]),
        Frame(step_kind=StepKind.DECODE, tensors={"x" * 25: t}),
        Frame(step_kind=StepKind.DECODE, tensors={"a\0b": t}),
        Frame(step_kind=StepKind.DECODE, tensors={"hidden": torch.zeros(2, dtype=torch.complex64)}),
        Frame(step_kind=StepKind.DECODE, tensors={"hidden": torch.zeros([1] * 9)}),
        Frame(step_kind=StepKind.DECODE, stage_to=70000, control=[1]),  # the range error comes first
    ]
    for frame in declined:
        assert codec.encode_fast(frame) is None
        results = []
        for encode in (codec.encode_parts, codec_reference.encode_parts):
            try:
                head, parts = encode(frame, checksum=True)
                results.append(bytes(head) + b"".join(bytes(p) for p in parts))
            except (TypeError, ValueError, struct.error) as e:
                results.append((type(e), str(e)))
        assert results[0] == results[1]
    assert isinstance(results[0], tuple) and "stage_to" in results[0][1]


def test_descriptors_encode_and_decode_as_the_reference_does():
    """A descriptor (its tensors' bytes elsewhere, e.g. in a GPU ring slot): the same head from
    both encoders, and fuzzed descriptors decode alike against a payload buffer."""
    rng = random.Random(2)
    for frame in sample_frames():
        for check in (True, False):
            head, spans = codec.encode_descriptor(frame, checksum=check)
            ref_head = codec_reference.encode_parts(frame, checksum=check, detached=True)[0]
            assert bytes(head) == bytes(ref_head) and codec.is_descriptor(head)
            assert spans == [(off, t.numel() * t.element_size()) for off, t in zip(_offsets(frame), frame.tensors.values())]
        payload = torch.zeros(max(frame.payload_bytes, 1) + 64, dtype=torch.uint8)
        for (off, n), t in zip(spans, frame.tensors.values()):
            payload[off : off + n] = t.contiguous().reshape(-1).view(torch.uint8)
        good = bytes(head)
        for i in range(200):
            b = bytearray(good)
            for _ in range(rng.choice([0, 1, 2])):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            buf = reseal(bytes(b)) if rng.random() < 0.85 else bytes(b)
            room = payload if rng.random() < 0.8 else payload[: max(0, frame.payload_bytes - 1)]
            fast = outcome(lambda: decode_frame(buf, payload=room, copy=bool(i % 2)))
            ref = outcome(lambda: codec_reference.decode(memoryview(buf), payload=room, copy=bool(i % 2)))
            assert fast == ref, (frame.step_kind, buf.hex())
        view = decode_frame(good, payload=payload, copy=False)
        for name, t in frame.tensors.items():
            assert torch.equal(view.tensors[name], t)
            if t.numel():
                assert payload.data_ptr() <= view.tensors[name].data_ptr() < payload.data_ptr() + payload.numel()


def _offsets(frame: Frame) -> list[int]:
    out, end = [], 0
    for t in frame.tensors.values():
        end = (end + 63) // 64 * 64
        out.append(end)
        end += t.numel() * t.element_size()
    return out


def test_a_descriptor_and_a_whole_frame_are_not_taken_for_each_other():
    frame = sample_frames()[0]
    head, _ = codec.encode_descriptor(frame)
    with pytest.raises(FrameError, match="descriptor frame .* where a whole frame was expected") as err:
        decode_frame(head)
    assert err.value.field == "frame_flags"
    with pytest.raises(FrameError, match="a whole frame arrived where a descriptor was expected"):
        decode_frame(encode_frame(frame), payload=torch.zeros(1024, dtype=torch.uint8))
    with pytest.raises(FrameError, match="need 96 bytes, the memory they lie in has 95") as err:
        decode_frame(head, payload=torch.zeros(95, dtype=torch.uint8))
    assert err.value.field == "payload_bytes"
    with pytest.raises(TypeError, match="1-D uint8 tensor"):
        decode_frame(head, payload=bytearray(96))

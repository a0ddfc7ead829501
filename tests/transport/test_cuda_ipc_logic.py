"""The cuda-ipc link's logic on the CPU: CudaIpcChannel over real TCP channels and a stand-in
ring whose slots are CPU tensors (the real ring's slots are GPU memory, which this machine may
not have). Tensors go through the slots at the offsets of the frame's own tensor table, the
descriptor over TCP is checked like any frame, frames without ring tensors and oversized ones go
over TCP whole, in order, and a bad descriptor costs only its own frame."""

from __future__ import annotations

import collections
import threading

import crc32c
import pytest
import torch

from stagewise.transport import Frame, FrameError, Hello, Row, StepKind, tcp
from stagewise.transport.codec import encode_descriptor
from stagewise.transport.rings import CudaIpcChannel

HELLO = Hello(fingerprint="fp", stage_from=0, stage_to=1)


class CpuSlotRing:
    """Both ends of an in-process ring with CPU tensor slots and the CudaIpcRing interface."""

    def __init__(self, slot_bytes: int, num_slots: int) -> None:
        self.name, self.slot_bytes, self.slot_device = "cpu-stand-in", slot_bytes, torch.device("cpu")
        self.slots = [torch.full((slot_bytes,), 0xEE, dtype=torch.uint8) for _ in range(num_slots)]
        self.free, self.ready = collections.deque(range(num_slots)), collections.deque()
        self.reserved = self.acquired = None
        self.released = 0
        self.closed = False

    def reserve(self, nbytes: int, timeout=None) -> torch.Tensor:
        self.reserved = self.free.popleft()
        return self.slots[self.reserved][:nbytes]

    def commit(self, nbytes: int) -> None:
        self.ready.append((self.reserved, nbytes))

    def acquire(self, timeout=None) -> torch.Tensor:
        self.acquired, nbytes = self.ready.popleft()
        return self.slots[self.acquired][:nbytes]

    def release(self) -> None:
        self.free.append(self.acquired)
        self.released += 1

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def link():
    """(sending end, receiving end, ring): two CudaIpcChannels over a loopback TCP pair."""
    ring = CpuSlotRing(4096, 3)
    with tcp.listen(hello=HELLO) as lis:
        box = {}
        t = threading.Thread(target=lambda: box.update(ch=lis.accept()))
        t.start()
        out = tcp.connect(*lis.address, hello=HELLO)
        t.join()
    sender = CudaIpcChannel(out, ring, sending=True)
    receiver = CudaIpcChannel(box["ch"], ring, sending=False)
    yield sender, receiver, ring
    sender.close()
    receiver.close()


def test_tensors_go_through_slots_at_the_tensor_table_offsets(link):
    sender, receiver, ring = link
    frame = Frame(step_kind=StepKind.MIXED, step_id=5, rows=[Row(1, 0, 2), Row(2, 7, 1)], control={"k": 1},
                  tensors={"hidden": torch.randn(1, 3, 8), "positions": torch.tensor([0, 1, 7]),
                           "empty": torch.zeros(0, 4, dtype=torch.int8), "mask": torch.tensor([True, False])})  # fmt: skip
    sender.send(frame)
    got = receiver.recv()
    assert (got.step_id, got.rows, got.control) == (5, frame.rows, {"k": 1})
    _, spans = encode_descriptor(frame)
    slot = ring.slots[0]
    for (offset, nbytes), (name, t) in zip(spans, frame.tensors.items()):
        assert torch.equal(got.tensors[name], t) and got.tensors[name].dtype == t.dtype
        if nbytes:  # a view of the slot at the offset the tensor table gives
            assert got.tensors[name].data_ptr() == slot.data_ptr() + offset
    assert ring.released == 0
    sender.send(Frame(step_kind=StepKind.HEARTBEAT, step_id=6))  # no ring tensors: over TCP whole
    assert receiver.recv().step_id == 6 and ring.released == 1  # the previous slot went back


def test_order_is_kept_across_slots_tcp_frames_and_oversized_frames(link):
    sender, receiver, ring = link
    sizes = [4, 0, 2000, 1, 0, 3]  # 2000 floats do not fit a 4 KB slot: whole over TCP
    for i, n in enumerate(sizes):
        tensors = {"hidden": torch.full((n, 1), float(i))} if n else {}
        sender.send(Frame(step_kind=StepKind.DECODE if n else StepKind.HEARTBEAT, step_id=i, tensors=tensors))
    for i, n in enumerate(sizes):
        got = receiver.recv()
        assert got.step_id == i and (not n or torch.equal(got.tensors["hidden"], torch.full((n, 1), float(i))))
    assert len(ring.free) + len(ring.ready) == 2  # one slot held by the last frame's views


def test_a_bad_descriptor_costs_its_frame_only(link):
    sender, receiver, ring = link
    good = Frame(step_kind=StepKind.DECODE, step_id=1, tensors={"hidden": torch.randn(2, 4)})
    head, _ = encode_descriptor(good)
    bad = bytearray(head)
    bad[40] ^= 1  # hidden_size: resealed below, so the shape check (not the checksum) catches it
    bad[72:80] = bytes(8)
    bad[72:76] = crc32c.crc32c(bytes(bad)).to_bytes(4, "little")
    ring.reserve(good.payload_bytes)
    ring.commit(good.payload_bytes)
    sender.tcp.send_bytes(bytes(bad))
    sender.send(Frame(step_kind=StepKind.DECODE, step_id=2, tensors={"hidden": torch.ones(2, 4)}))
    with pytest.raises(FrameError) as err:
        receiver.recv()
    assert err.value.field == "hidden_size" and ring.released == 1  # its slot went back at once
    got = receiver.recv()
    assert got.step_id == 2 and torch.equal(got.tensors["hidden"], torch.ones(2, 4))
    assert receiver.stats.bad_frames == 1


def test_a_frame_mixing_ring_and_other_tensors_is_refused(link):
    sender, _, _ = link
    frame = Frame(step_kind=StepKind.DECODE, tensors={"hidden": torch.zeros(2), "meta": torch.zeros(2, device="meta")})
    with pytest.raises(ValueError, match="holds only such tensors; 'meta' is on meta"):
        sender.send(frame)

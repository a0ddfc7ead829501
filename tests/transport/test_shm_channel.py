"""The shm transport: frames through a shared-memory ring set up on an authenticated TCP
channel — in order, bit-exact, zero-copy on the receiving end, oversized frames over TCP
without reordering, and a closed peer reported as ChannelClosed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from stagewise.transport import Hello, tcp
from stagewise.transport.errors import ChannelClosed
from stagewise.transport.frame import Frame, Row, StepKind
from stagewise.transport.rings import ShmChannel, open_link


@pytest.fixture
def pair():
    """(sending end, receiving end) of an authenticated link on shm with 4 slots of 64 KiB."""
    hello = Hello(fingerprint="fp", stage_from=0, stage_to=1)
    with tcp.listen(hello=hello, auth_token="secret") as lis:
        got = {}
        t = threading.Thread(target=lambda: got.update(ch=open_link("shm", hello=hello, listener=lis)))
        t.start()
        sender = open_link("shm", hello=hello, host=lis.address[0], port=lis.address[1], auth_token="secret",
                           slot_bytes=64 << 10, num_slots=4)
        t.join()
    receiver = got["ch"]
    assert isinstance(sender, ShmChannel) and isinstance(receiver, ShmChannel)
    yield sender, receiver
    sender.close()
    receiver.close()


def _frame(i: int, rows: int) -> Frame:
    g = torch.Generator().manual_seed(i)
    return Frame(step_kind=StepKind.DECODE, step_id=i, microbatch=i % 3, stage_from=0, stage_to=1,
                 rows=[Row(100 + r, 7 + r, 1) for r in range(rows)],
                 tensors={"hidden": torch.randn(rows, 64, generator=g)}, control={"n": i})


def test_frames_arrive_in_order_bit_exact_and_in_place(pair):
    sender, receiver = pair
    sizes = [1, 3, 250, 2, 400, 1, 600, 5] * 8  # 250+ rows x 256 B exceed a 64 KiB slot: TCP, in order
    done = threading.Event()

    def produce():
        for i, n in enumerate(sizes):
            sender.send(_frame(i, n))
        done.set()

    ring = receiver.ring
    lo, hi = ring.slot_address(0), ring.slot_address(ring.num_slots - 1) + ring.slot_bytes
    t = threading.Thread(target=produce)
    t.start()
    for i, n in enumerate(sizes):
        frame = receiver.recv(timeout=30)
        want = _frame(i, n)
        assert frame.step_id == i and frame.control == {"n": i} and frame.rows == want.rows
        assert torch.equal(frame.tensors["hidden"], want.tensors["hidden"])
        ptr = frame.tensors["hidden"].data_ptr()
        in_ring = lo <= ptr < hi
        assert in_ring == (n * 64 * 4 < 60_000)  # in a slot: a view of the shared memory; else from TCP
    t.join()
    assert done.is_set()
    assert sender.stats.frames_sent == len(sizes) == receiver.stats.frames_received


def test_a_closed_sender_is_channel_closed(pair):
    sender, receiver = pair
    sender.send(_frame(0, 2))
    sender.close()
    assert receiver.recv(timeout=10).step_id == 0  # what was committed still arrives
    with pytest.raises(ChannelClosed):
        receiver.recv(timeout=10)


def test_the_reverse_direction_uses_tcp(pair):
    sender, receiver = pair
    receiver.send(Frame(step_kind=StepKind.CONTROL, control={"op": "hello back"}))
    assert sender.recv(timeout=10).control == {"op": "hello back"}


@pytest.mark.parametrize("transport,kind", [("shm", ShmChannel), ("tcp", tcp.TcpChannel)])
def test_open_link_sets_up_either_end(transport, kind):
    hello = Hello(fingerprint="fp", stage_from=0, stage_to=1)
    with tcp.listen(hello=hello) as lis:
        box = {}
        t = threading.Thread(target=lambda: box.update(ch=open_link(transport, hello=hello, listener=lis, timeout=None)))
        t.start()
        sender = open_link(transport, hello=hello, host=lis.address[0], port=lis.address[1], slot_bytes=4096,
                           num_slots=2)  # fmt: skip
        t.join()
    receiver = box["ch"]
    with sender, receiver:
        assert isinstance(sender, kind) and isinstance(receiver, kind)
        sender.send(Frame(step_kind=StepKind.DECODE, step_id=3, tensors={"hidden": torch.arange(4.0)}))
        assert torch.equal(receiver.recv().tensors["hidden"], torch.arange(4.0))


def test_unknown_link_transports_are_refused():
    with pytest.raises(ValueError, match="one of \\('tcp', 'shm', 'cuda-ipc'\\), got 'torch'"):
        open_link("torch", hello=Hello(fingerprint="fp", stage_from=0, stage_to=1), host="127.0.0.1", port=1)


def test_the_receiver_warms_its_path_on_the_last_frame_when_the_next_is_due(pair):
    # Frames every 50 ms: once the receiver knows that rhythm, each wait sleeps until the next
    # frame is due and then runs `warm` on a copy of the last small frame (not on a large one);
    # a warm that fails is dropped, the frames still come.
    sender, receiver = pair
    warmed: list[tuple[int, float]] = []
    receiver.warm = lambda frame: warmed.append((frame.step_id, time.perf_counter()))
    sizes = [1] * 6 + [300, 1, 1]  # 300 rows: 77 KB, over the size kept for warming
    sent: list[float] = []

    def produce():
        for i, n in enumerate(sizes):
            time.sleep(0.05)
            sent.append(time.perf_counter())
            sender.send(_frame(i, n))

    t = threading.Thread(target=produce)
    t.start()
    got, received = [], []
    for _ in sizes:
        got.append(receiver.recv(timeout=30).step_id)
        received.append(time.perf_counter())
    t.join()
    assert got == list(range(len(sizes)))
    assert warmed and 6 not in [i for i, _ in warmed]  # the large frame was not kept
    for i, at in warmed:  # a frame already received, while the next one was awaited (not yet sent)
        k = next(k for k, r in enumerate(received) if r > at)
        assert i < k and at < sent[k] + 0.02, (i, k)
    receiver.warm = lambda frame: 1 / 0
    for i in range(3):
        time.sleep(0.05)
        sender.send(_frame(100 + i, 1))
        assert receiver.recv(timeout=30).step_id == 100 + i

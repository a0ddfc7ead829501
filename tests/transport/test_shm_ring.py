"""The shared-memory activation ring (stagewise.transport.rings.shm_ring, csrc/cpu/ring.cpp).

Between two real processes (tests/helpers/ring_peer.py is the other one): thousands of
messages of random sizes checked byte for byte in both directions, through the
extension's direct functions and through the torch ops; back-pressure; a peer's
close and a peer's death; several rings at once. In one process: timeouts,
oversize messages, bad names, missing or foreign segments, no leak in /dev/shm,
views that die with their slot, waits that release the GIL and use no CPU, and
the torch ops on a plain tensor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
import torch

from helpers.ring_peer import finish, messages, spawn
from stagewise import _C
from stagewise.transport.rings import SHM_DIR, RingClosedError, ShmRing

ops = torch.ops.stagewise


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def wait_attached(name: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    """A peer's attach removes the name."""
    deadline = time.monotonic() + timeout
    while os.path.exists(shm_path(name)):
        assert proc.poll() is None and time.monotonic() < deadline, "the peer did not attach"
        time.sleep(0.01)


@pytest.fixture
def name():
    n = ShmRing.unique_name("test-ring")
    yield n
    leaked = os.path.exists(shm_path(n))
    if leaked:
        os.unlink(shm_path(n))
    assert not leaked, f"{shm_path(n)} was left behind"


@pytest.fixture
def pair(name):
    """Both ends of a ring of 4 slots of 256 bytes, in this process."""
    writer = ShmRing.create(name, 256, 4)
    reader = ShmRing.attach(name)
    yield writer, reader
    writer.close()
    reader.close()


# ---- two processes ---------------------------------------------------------------


@pytest.mark.parametrize("direction", ["creator-writes", "attacher-writes-through-torch-ops"])
def test_random_messages_between_processes_arrive_intact_and_in_order(name, direction):
    seed, count, slot_bytes = 1234, 3000, 3000  # 3 slots: the counters wrap around the ring ~1000 times
    ring = ShmRing.create(name, slot_bytes, 3)
    if direction == "creator-writes":
        peer = spawn("read", name, seed, count, 0)
        for data in messages(seed, count, slot_bytes):
            ring.send(data, timeout=60)
        ring.close()
    else:
        peer = spawn("write", name, seed, count, "ops")
        for i, expected in enumerate(messages(seed, count, slot_bytes)):
            view = ring.acquire(timeout=60)
            assert view.readonly and view == expected, f"message {i}"
            ring.release()
        with pytest.raises(RingClosedError, match="closed by the other end"):
            ring.acquire(timeout=60)
        ring.close()
    finish(peer)


def test_a_full_ring_blocks_the_writer_until_the_reader_frees_a_slot(name):
    seed, count = 7, 40
    data = list(messages(seed, count, 128))
    ring = ShmRing.create(name, 128, 2)
    ring.send(data[0])
    ring.send(data[1])
    with pytest.raises(TimeoutError, match="no free slot"):
        ring.reserve(1, timeout=0)
    peer = spawn("read", name, seed, count, 0.5)  # attaches, then sleeps before reading
    t0 = time.monotonic()
    ring.send(data[2], timeout=60)
    assert time.monotonic() - t0 > 0.3, "the writer should have waited for the slow reader"
    for d in data[3:]:
        ring.send(d, timeout=60)
    ring.close()
    finish(peer)


def test_several_rings_at_once():
    names = [ShmRing.unique_name("test-ring") for _ in range(4)]
    rings = [ShmRing.create(n, 1000, 2) for n in names]
    peers = [spawn("echo", names[0], names[1]), spawn("echo", names[2], names[3])]
    try:
        for i, data in enumerate(messages(99, 400, 1000)):
            rings[0].send(data, timeout=60)
            rings[2].send(data[::-1], timeout=60)
            assert rings[1].recv(timeout=60) == data, f"message {i} on the first pair"
            assert rings[3].recv(timeout=60) == data[::-1], f"message {i} on the second pair"
    finally:
        for r in rings:
            r.close()
    for p in peers:
        finish(p)
    assert not any(os.path.exists(shm_path(n)) for n in names)


@pytest.mark.parametrize("dies", ["attacher", "creator"])
def test_a_killed_peer_ends_the_wait_and_leaves_nothing_in_dev_shm(name, dies):
    if dies == "attacher":
        ring = ShmRing.create(name, 64, 2)
        peer = spawn("hold-attached", name)
        wait_attached(name, peer)
    else:
        peer = spawn("hold-created", name, 64, 2)
        ring = ShmRing.attach(name, timeout=60)
    assert not os.path.exists(shm_path(name))  # the attach removed the name: nothing can leak now
    peer.send_signal(signal.SIGKILL)
    peer.wait(timeout=60)
    t0 = time.monotonic()
    with pytest.raises(RingClosedError):
        ring.acquire(timeout=10)
    assert time.monotonic() - t0 < 2, "a dead peer is noticed within ~20 ms of waiting"
    ring.close()


# ---- one process: errors, timeouts, lifetime ---------------------------------------


def test_timeouts(pair):
    writer, reader = pair
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no message"):
        reader.acquire(timeout=0.05)
    assert 0.04 < time.monotonic() - t0 < 2
    for _ in range(4):
        writer.send(b"x")
    with pytest.raises(TimeoutError, match="no free slot"):
        writer.reserve(1, timeout=0.05)
    assert reader.recv() == b"x"
    writer.send(b"y", timeout=0)  # a slot is free again


def test_close_by_either_end(pair):
    writer, reader = pair
    writer.send(b"last words")
    writer.close()
    assert reader.closed
    assert reader.recv(timeout=0) == b"last words"  # committed messages are still delivered
    with pytest.raises(RingClosedError):
        reader.acquire(timeout=1)
    with pytest.raises(RingClosedError, match="closed by this end"):
        writer.reserve(1)


def test_reader_close_stops_a_blocked_writer(name):
    writer = ShmRing.create(name, 16, 1)
    reader = ShmRing.attach(name)
    writer.send(b"a")
    threading.Timer(0.1, reader.close).start()
    with pytest.raises(RingClosedError, match="closed by the other end"):
        writer.reserve(1, timeout=10)
    writer.close()


def test_closing_an_end_from_another_thread_ends_its_wait(name):
    writer = ShmRing.create(name, 16, 1)
    reader = ShmRing.attach(name)
    threading.Timer(0.1, reader.close).start()
    with pytest.raises(RingClosedError):
        reader.acquire(timeout=10)
    writer.close()


def test_oversize_messages_are_refused(pair):
    writer, reader = pair
    with pytest.raises(ValueError, match=r"'nbytes' must be in \[0, slot_bytes=256\].*got 257"):
        writer.reserve(257)
    with pytest.raises(ValueError, match="got 300"):
        writer.send(bytes(300))
    writer.reserve(10)
    with pytest.raises(ValueError, match="'nbytes' must be at most the slot size 256, got 257"):
        writer.commit(257)
    writer.commit(256)  # the whole slot, more than reserved, is allowed
    assert len(reader.acquire()) == 256


def test_protocol_misuse_is_a_clear_error(pair):
    writer, reader = pair
    with pytest.raises(RuntimeError, match="no reserved slot"):
        writer.commit()
    with pytest.raises(RuntimeError, match="no acquired message"):
        reader.release()
    writer.reserve(1)
    with pytest.raises(RuntimeError, match="already has a reserved slot"):
        writer.reserve(1)


def test_views_die_with_their_slot(pair):
    writer, reader = pair
    view = writer.reserve(4)
    view[:] = b"abcd"
    writer.commit()
    with pytest.raises(ValueError):  # released memoryview
        view[0] = 1
    got = reader.acquire()
    assert got == b"abcd"
    with pytest.raises(TypeError):  # read-only
        got[0] = 1
    reader.release()
    with pytest.raises(ValueError):
        bytes(got)


def test_tensors_travel_without_a_copy_on_the_reader(pair):
    writer, reader = pair
    x = torch.randn(64)
    torch.frombuffer(writer.reserve(x.numel() * 4), dtype=torch.float32).copy_(x)
    writer.commit()
    view = reader.acquire()
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # torch warns once per process; an earlier test may have had that warning
    try:
        with pytest.warns(UserWarning, match="not writable"):
            y = torch.frombuffer(view, dtype=torch.float32)
    finally:
        torch.set_warn_always(warn_always)
    assert torch.equal(y, x)
    assert y.data_ptr() == reader.slot_address(0), "the reader's tensor is the slot itself"
    del y
    reader.release()


def test_attach_to_a_missing_or_foreign_segment(name):
    with pytest.raises(FileNotFoundError, match=f"no ring named '{name}'"):
        ShmRing.attach(name)
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError):
        ShmRing.attach(name, timeout=0.1)
    assert time.monotonic() - t0 >= 0.1
    with open(shm_path(name), "wb") as f:
        f.write(b"\0" * 8192)
    try:
        with pytest.raises(ValueError, match="not a ring of this kind.*magic"):
            ShmRing.attach(name)
    finally:
        os.unlink(shm_path(name))


def test_names_and_sizes_are_checked(name):
    for bad in ("", "a/b", ".hidden", "x" * 300):
        with pytest.raises(ValueError, match="argument 'name'"):
            ShmRing.create(bad, 64, 2)
    with pytest.raises(ValueError, match="argument 'slot_bytes'"):
        ShmRing.create(name, 0, 2)
    with pytest.raises(ValueError, match="argument 'num_slots'"):
        ShmRing.create(name, 64, 0)
    ring = ShmRing.create(name, 64, 2)
    with pytest.raises(FileExistsError, match="already exists"):
        ShmRing.create(name, 64, 2)
    ring.close()


def test_no_segment_is_left_behind(name):
    ShmRing.create(name, 64, 2).close()  # never attached: close removes the name
    assert not os.path.exists(shm_path(name))
    ring = ShmRing.create(name, 64, 2)
    del ring  # dropped without close: the finalizer removes it
    assert not os.path.exists(shm_path(name))
    with ShmRing.create(name, 64, 2) as ring, ShmRing.attach(name) as peer:
        ring.send(b"x")
        assert peer.recv() == b"x"
    assert not os.path.exists(shm_path(name))
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(name)]  # nor a temporary file


def test_a_process_about_to_be_killed_removes_the_names_it_published(name):
    """A ring offered and never attached (its peer gone quiet) keeps its name until its creator
    closes it; a process that will be killed without unwinding removes the names first."""
    from stagewise.transport.rings.segment import remove_names

    ring = ShmRing.create(name, 64, 2)
    with ShmRing.create(name + "-b", 64, 2), ShmRing.attach(name + "-b"):
        assert os.path.exists(shm_path(name)) and not os.path.exists(shm_path(name + "-b"))
        assert remove_names() == 1  # the attached one's name is already gone
    assert not os.path.exists(shm_path(name))
    with pytest.raises(FileNotFoundError, match="no ring named"):
        ShmRing.attach(name, timeout=0.1)
    assert remove_names() == 0
    ring.close()


@pytest.mark.parametrize("path", ["direct", "torch-ops"])
def test_a_blocked_wait_releases_the_gil_and_uses_no_cpu(path):
    # A ring in a plain tensor, and one 3-second call into C++ (ShmRing splits long waits in
    # 0.1 s calls, which would hide a held GIL): the extension's function or the torch op.
    ring = torch.zeros(ops.ring_bytes(256, 4, False), dtype=torch.uint8)
    ops.ring_init(ring, 256, 4, False, 50)
    if path == "direct":
        wait = lambda: _C.ring_acquire(ring.data_ptr(), ring.numel(), 3_000_000, 0)  # noqa: E731
    else:
        wait = lambda: ops.ring_acquire(ring, 3_000_000)  # noqa: E731
    got = []
    thread = threading.Thread(target=lambda: got.append(wait()))
    cpu0 = time.process_time()
    thread.start()
    time.sleep(0.5)  # the reader waits meanwhile; then this thread must get the GIL at once
    cpu = time.process_time() - cpu0
    t0 = time.monotonic()
    slot = ops.ring_reserve(ring, 0)
    ops.ring_commit(ring, slot, 7)
    thread.join(timeout=10)
    assert time.monotonic() - t0 < 1.5, "the waiting reader held the GIL"
    assert got and tuple(got[0]) == (0, 7), f"the reader got {got}, not the message"
    assert cpu < 0.1, f"a waiting reader used {cpu:.3f} CPU s in 0.5 s"


def test_the_reader_paces_its_waits_and_an_early_message_still_wakes_it(pair):
    # Messages every 60 ms: the reader learns to expect a ~60 ms wait, sleeps through most of it
    # and spins near its end (include/stagewise/ring.h). One that then comes after 5 ms must wake
    # it at once, not when the spin would begin (~50 ms).
    writer, reader = pair
    assert reader.pacing == (None, False)
    sent: list[float] = []

    def write(gaps):
        for gap in gaps:
            time.sleep(gap)
            sent.append(time.perf_counter())  # before the send: the reader may get it at once
            writer.send(b"x")

    thread = threading.Thread(target=write, args=([0.06] * 5,))
    thread.start()
    for _ in range(5):
        reader.recv(timeout=5)
    thread.join()
    expected, waiting = reader.pacing
    assert expected is not None and 0.02 < expected < 0.5 and not waiting
    writer.send(b"y")  # there at once: nothing learnt, no wait under way
    reader.recv(timeout=1)
    assert reader.pacing == (expected, False)
    thread = threading.Thread(target=write, args=([0.005],))
    thread.start()
    reader.recv(timeout=5)
    late = time.perf_counter() - sent[-1]
    thread.join()
    assert late < 0.02, f"a message that came before the reader's spin reached it {late * 1e3:.1f} ms late"
    assert ops.ring_info(writer._segment.tensor)[11:13] == ops.ring_info(reader._segment.tensor)[11:13]


def test_on_due_runs_while_the_message_is_due_and_not_before(pair):
    # Messages every 60 ms teach the reader its rhythm; the next one comes 5 ms late, inside the
    # spin window (an eighth of 60 ms either side): on_due runs from the window's start, every
    # DUE_EVERY_US while the reader spins, and never before the window nor after the message.
    writer, reader = pair
    sent: list[float] = []

    def write(gaps):
        for gap in gaps:
            time.sleep(gap)
            sent.append(time.perf_counter())
            writer.send(b"x")

    thread = threading.Thread(target=write, args=([0.06] * 5 + [0.065],))
    thread.start()
    calls: list[float] = []
    for i in range(6):
        start = time.perf_counter()
        reader.acquire(timeout=5, on_due=lambda: calls.append(time.perf_counter()))
        got = time.perf_counter()
        reader.release()
        if i < 5:
            calls.clear()
    thread.join()
    assert len(calls) >= 5, f"on_due ran {len(calls)} times while the message was due"
    assert start + 0.045 < calls[0] and calls[-1] < got
    assert all(b - a < 0.005 for a, b in zip(calls, calls[1:]))  # every DUE_EVERY_US, give or take


# ---- the torch ops on a plain tensor -------------------------------------------------


def test_torch_ops_on_a_plain_tensor():
    size = ops.ring_bytes(100, 3, False)
    assert size == 4096 + 3 * 128  # a page of header and sizes, then slots of 100 bytes padded to 128
    ring = torch.zeros(size, dtype=torch.uint8)
    ops.ring_init(ring, 100, 3, False, 0)
    info = ops.ring_info(ring)
    slot_bytes, num_slots, stride, offset, flags, head, tail, closed, user_offset, creator, attacher, *pacing = info
    assert pacing == [0, 0, 0]  # nothing waited for yet
    assert (slot_bytes, num_slots, stride, flags, head, tail, closed) == (100, 3, 128, 0, 0, 0, 0)
    assert (creator, attacher) == (os.getpid(), 0)
    ops.ring_attach(ring)
    assert ops.ring_info(ring)[10] == os.getpid()
    assert 0 < user_offset and user_offset + 128 <= offset
    assert offset % 4096 == 0 and offset + 3 * stride == size
    for i in range(7):  # wraps around twice
        slot = ops.ring_reserve(ring, 0)
        assert slot == i % 3
        ring[offset + slot * stride] = i
        ops.ring_commit(ring, slot, i)
        assert ops.ring_acquire(ring, 0) == (slot, i)
        assert ring[offset + slot * stride] == i
        ops.ring_release(ring, slot)
    assert ops.ring_acquire(ring, 0)[0] == -1  # timed out: empty
    with pytest.raises(ValueError, match="'slot' must be the reserved slot 1, got 2"):
        ops.ring_commit(ring, 2, 1)
    with pytest.raises(ValueError, match="no message to release"):
        ops.ring_release(ring, 1)
    ops.ring_close(ring)
    assert ops.ring_reserve(ring, 0) == -2
    with pytest.raises(TypeError, match="uint8"):
        ops.ring_reserve(ring.view(torch.int32), 0)
    with pytest.raises(ValueError, match="not a valid ring"):
        ops.ring_reserve(torch.zeros(size, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="not a valid ring.*smaller"):
        ops.ring_reserve(ring[: size // 2], 0)

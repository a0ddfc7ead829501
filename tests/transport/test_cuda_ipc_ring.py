"""The CUDA IPC activation ring (stagewise.transport.rings.cuda_ipc_ring, csrc/cuda/ring.cu).

The tests marked `cuda` need one GPU and run two processes on it (tests/helpers/ring_peer.py is
the other): random messages checked byte for byte in both directions, the name and the
handle as ways to attach, and a commit that does not wait for the producer's GPU. The rest
runs anywhere: the handle's bytes, the errors without a GPU, the kind check.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from helpers.ring_peer import as_tensor, finish, messages, spawn
from stagewise.transport.rings import SHM_DIR, CudaIpcRing, RingClosedError, RingHandle, ShmRing

HAS_CUDA = torch.cuda.is_available()
cuda = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


def test_handle_bytes_round_trip_and_bad_handles():
    h = RingHandle("stage-1-to-2", 3, 1 << 20, 4096, 8, bytes(range(64)))
    data = h.pack()
    assert isinstance(data, bytes) and RingHandle.unpack(data) == h
    assert data[:8] == b"SWCUDAR1" and data.endswith(b"stage-1-to-2")
    with pytest.raises(ValueError, match="not a CUDA IPC ring handle"):
        RingHandle.unpack(b"SWRING01" + data[8:])
    with pytest.raises(ValueError, match="not a CUDA IPC ring handle"):
        RingHandle.unpack(data[:20])
    with pytest.raises(ValueError, match="version 9"):
        RingHandle.unpack(data[:8] + (9).to_bytes(4, "little") + data[12:])


@pytest.mark.skipif(HAS_CUDA, reason="checks the message without a GPU")
def test_without_a_gpu_the_error_says_so():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        CudaIpcRing.create(ShmRing.unique_name("test-ring"), 64, 2)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        CudaIpcRing.attach("anything")


def test_a_shm_ring_is_not_attached_as_the_other_kind():
    name = ShmRing.unique_name("test-ring")
    host_half = CudaIpcRing.create_segment(name, 64, 2)  # a CUDA ring's host half, no GPU needed
    try:
        with pytest.raises(ValueError, match="is a CudaIpcRing"):
            ShmRing.attach(name)
        assert os.path.exists(os.path.join(SHM_DIR, name)), "a refused attach leaves the ring as it was"
    finally:
        host_half.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("direction", ["creator-writes", "attacher-writes-by-handle"])
def test_random_messages_between_two_processes_on_one_gpu(direction):
    seed, count, slot_bytes = 4321, 500, 5000
    name = ShmRing.unique_name("test-ring")
    ring = CudaIpcRing.create(name, slot_bytes, 3)
    if direction == "creator-writes":
        peer = spawn("cuda-read", name, seed, count)
        # The first message is filled behind ~0.5 s of GPU work: its commit must not wait for it.
        # It is on the GPU before that work is queued: a copy from host memory would itself wait.
        sent = list(messages(seed, count, slot_bytes))
        first = as_tensor(sent[0], "cuda")
        torch.cuda._sleep(int(0.5 * torch.cuda.get_device_properties(0).clock_rate * 1000))
        t0 = time.monotonic()
        for i, data in enumerate(sent):
            ring.send(first if i == 0 else as_tensor(data, "cuda"), timeout=60)
            if i == 0:
                assert time.monotonic() - t0 < 0.25, "the first commit waited for the GPU"
        ring.close()  # waits until the reader has drained the ring and detached
    else:
        peer = spawn("cuda-write", ring.handle.hex(), seed, count)
        for i, expected in enumerate(messages(seed, count, slot_bytes)):
            view = ring.acquire(timeout=60)
            assert torch.equal(view, as_tensor(expected, "cuda")), f"message {i}"
            ring.release()
        with pytest.raises(RingClosedError):
            ring.acquire(timeout=60)
        ring.close()
    finish(peer)
    assert not os.path.exists(os.path.join(SHM_DIR, name))

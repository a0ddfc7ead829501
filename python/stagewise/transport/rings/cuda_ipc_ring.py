"""CUDA IPC activation ring: the ring of :mod:`~stagewise.transport.rings.host_ring` with its slots
in GPU memory.

UNVERIFIED ON HARDWARE: compile-checked for sm_90 only; its tests (marked ``cuda``,
tests/transport/test_cuda_ipc_ring.py) have not yet run on a GPU.

The slots (and two 32-bit counters) are one ``cudaMalloc`` allocation of the creator,
mapped by the peer through CUDA IPC (the two processes may share one GPU). A host
ring (a shared-memory segment like :class:`~stagewise.transport.rings.ShmRing`'s, without
slot bytes) carries each message's slot and size and does the back-pressure between
the hosts; the bytes are ordered on the GPU by stream memory operations
(``cuStreamWaitValue32`` / ``cuStreamWriteValue32``, csrc/cuda/ring.cu):

* ``reserve`` makes the current stream wait until the reader's stream has released the
  slot's previous message; ``commit`` has the current stream bump the *ready* counter
  after the work that filled the slot, and publishes the slot on the host at once;
* ``acquire`` makes the current stream wait until *ready* covers the message;
  ``release`` has the current stream bump the *released* counter after the work that
  read the slot, and frees the slot on the host at once.

So no host thread waits for a GPU: a decode step is enqueued, committed and the next
one started while the GPU still works. Use the same current stream (of the ring's
device) for the calls and for the work on the slot. Views are CUDA uint8 tensors of
the slot (zero copy); after ``commit`` / ``release`` they must not be used.

The handle: ``ring.handle`` is a byte string (magic, geometry, the CUDA IPC handle, the
segment name) for a peer that learns of the ring over another channel (a hello on a
socket); ``CudaIpcRing.attach`` takes it or just the name. No pickle.

Closing: the creator frees the allocation only after the peer said its GPU is done with
it (the peer's ``close`` synchronises its device first), or the peer is gone; see
:meth:`CudaIpcRing.close`. Caveat, both ways: a producer that dies after ``commit`` but
before its GPU wrote *ready* leaves the reader's stream waiting, and a reader that dies
after releasing a slot on the host but before its GPU wrote *released* leaves the writer's
stream waiting (and the writer's ``close``, which synchronises its device, with it). The
runtime must then end the surviving process, as it does on any stage failure.

Two GPUs: the attaching process labels the mapping with its own device, so its streams
order the ring's work; the bytes of a ring on another GPU are then reached through peer
access, and ``attach`` refuses GPUs without it (use the torch/NCCL transport there).
"""

from __future__ import annotations

import os
import struct
import time
import warnings
from dataclasses import dataclass

import torch

from stagewise.transport.rings.host_ring import HostRing
from stagewise.transport.rings.segment import open_segment

__all__ = ["CudaIpcRing", "RingHandle", "CUDA_IPC_OPS"]

# The torch ops behind this module besides host_ring.RING_OPS (CUDA builds only).
CUDA_IPC_OPS = ("cuda_ipc_alloc", "cuda_ipc_handle", "cuda_ipc_open", "cuda_ring_wait", "cuda_ring_signal")

_ops = torch.ops.stagewise
_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_COUNTER_ALIGN = 128  # each counter on its own 128-byte line
_USER = struct.Struct("<64sQ")  # in the control header: the IPC handle, the allocation's size,
_DETACHED = _USER.size  # then one byte the peer sets once its GPU is done with the allocation
_HANDLE = struct.Struct("<8sIIQQQ64s")  # magic, version, device, gpu_bytes, slot_bytes, num_slots, IPC handle
_MAGIC, _VERSION = b"SWCUDAR1", 1


@dataclass(frozen=True, slots=True)
class RingHandle:
    """What a peer needs to attach to a CUDA IPC ring, as bytes (:meth:`pack` / :meth:`unpack`)."""

    name: str
    device: int
    """The creator's device index (informational: the peer maps the ring on its own device)."""
    gpu_bytes: int
    slot_bytes: int
    num_slots: int
    ipc_handle: bytes

    def pack(self) -> bytes:
        return _HANDLE.pack(_MAGIC, _VERSION, self.device, self.gpu_bytes, self.slot_bytes, self.num_slots,
                            self.ipc_handle) + self.name.encode()  # fmt: skip

    @staticmethod
    def unpack(data: bytes) -> RingHandle:
        data = bytes(data)
        if len(data) <= _HANDLE.size or data[:8] != _MAGIC:
            raise ValueError(
                f"stagewise.CudaIpcRing: argument 'handle' is not a CUDA IPC ring handle ({len(data)} bytes, "
                f"starting {data[:8]!r}; expected more than {_HANDLE.size} bytes starting {_MAGIC!r})"
            )
        magic, version, device, gpu_bytes, slot_bytes, num_slots, ipc = _HANDLE.unpack_from(data)
        if version != _VERSION:
            raise ValueError(f"stagewise.CudaIpcRing: handle version {version}, this stagewise reads {_VERSION}")
        return RingHandle(data[_HANDLE.size :].decode(), device, gpu_bytes, slot_bytes, num_slots, ipc)


_KEPT: list[torch.Tensor] = []  # allocations a live peer may still use (see CudaIpcRing.close)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _gpu_layout(num_slots: int, stride: int) -> tuple[int, int, int]:
    """(ready counter offset, released counter offset, allocation bytes): the counters follow the slots."""
    ready = (num_slots * stride + _COUNTER_ALIGN - 1) // _COUNTER_ALIGN * _COUNTER_ALIGN
    return ready, ready + _COUNTER_ALIGN, ready + 2 * _COUNTER_ALIGN


def _cuda_device(op: str, device) -> int:
    if not torch.cuda.is_available():
        raise RuntimeError(f"stagewise.CudaIpcRing.{op}: needs a CUDA GPU (torch.cuda.is_available() is False)")
    if device is None:
        return torch.cuda.current_device()
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if d.type != "cuda":
        raise ValueError(f"stagewise.CudaIpcRing.{op}: argument 'device' must be a CUDA device, got {device!r}")
    return d.index if d.index is not None else torch.cuda.current_device()


class CudaIpcRing(HostRing):
    """One end of a CUDA IPC ring; make it with :meth:`create` or :meth:`attach`."""

    _external_slots = True

    def __init__(self, name: str, segment, buf: torch.Tensor, device: int):
        super().__init__(name, segment)
        self.device = device
        self._buf = buf  # [gpu_bytes] uint8 on `device`: the slots, then the two counters
        self._ready, self._released, _ = _gpu_layout(self.num_slots, self._stride)
        self._slots = [buf.narrow(0, i * self._stride, self.slot_bytes) for i in range(self.num_slots)]
        self._sent = self._received = 0  # messages this end has committed / released
        self._reserved: int | None = None
        self._acquired: int | None = None

    @classmethod
    def create(cls, name: str, slot_bytes: int, num_slots: int = 4, *, device=None, spin_us: int = 50) -> CudaIpcRing:
        """Allocate ``num_slots`` slots of ``slot_bytes`` on ``device`` (default: current) and publish the ring
        under ``name`` (its host half is ``/dev/shm/<name>``)."""
        index = _cuda_device("create", device)
        bufs = []

        def user(info) -> bytes:  # runs before the segment is published
            _, _, gpu_bytes = _gpu_layout(info[1], info[2])
            bufs.append(_ops.cuda_ipc_alloc(gpu_bytes, index))
            handle = _ops.cuda_ipc_handle(bufs[0])
            return _USER.pack(bytes(handle.numpy().tobytes()), gpu_bytes)

        segment = cls.create_segment(name, slot_bytes, num_slots, spin_us, user)
        return cls(name, segment, bufs[0], index)

    @classmethod
    def attach(cls, spec: str | bytes, *, device=None, timeout: float = 0.0) -> CudaIpcRing:
        """Attach to a ring by name or by its :attr:`handle` bytes, mapping it on ``device`` (default: current)."""
        index = _cuda_device("attach", device)
        want = None if isinstance(spec, str) else RingHandle.unpack(spec)
        name = spec if want is None else want.name
        segment = open_segment(f"{cls.__name__}.attach", name, timeout, True)
        try:
            user = _ops.ring_info(segment.tensor)[8]
            ipc, gpu_bytes = _USER.unpack(bytes(segment.mm[user : user + _USER.size]))
            if want is not None and (want.ipc_handle, want.gpu_bytes) != (ipc, gpu_bytes):
                raise ValueError(f"stagewise.CudaIpcRing.attach: the handle does not match ring {name!r}'s header")
            buf = _ops.cuda_ipc_open(torch.frombuffer(bytearray(ipc), dtype=torch.uint8), gpu_bytes, index)
        except BaseException:
            segment.close()  # the creator's waits end: this peer will not come
            raise
        return cls(name, segment, buf, index)

    @property
    def slot_device(self) -> torch.device:
        """Where the slots are: this end's GPU (the views :meth:`reserve` / :meth:`acquire` return)."""
        return torch.device("cuda", self.device)

    @property
    def handle(self) -> bytes:
        """This ring as bytes for :meth:`attach` (no pickle)."""
        ipc, gpu_bytes = _USER.unpack(self._user_bytes(_USER.size))
        return RingHandle(self.name, self.device, gpu_bytes, self.slot_bytes, self.num_slots, ipc).pack()

    def close(self, timeout: float = 10.0) -> None:
        """End the ring. The peer first waits for its GPU work on the slots and says it is done; the
        creator waits up to ``timeout`` s for that before it frees the allocation (if the peer does
        not answer and lives on, the allocation is kept until this process exits, never freed under it)."""
        if self._buf is None:
            return
        torch.cuda.synchronize(self.device)  # this end's enqueued work on the slots
        seg = self._segment
        info = _ops.ring_info(seg.tensor)
        creator = info[9] == os.getpid() and info[10] != os.getpid()
        if not creator:
            seg.mm[info[8] + _DETACHED] = 1
        else:
            _ops.ring_close(seg.tensor)  # the peer's waits end now
            deadline = time.monotonic() + timeout
            while info[10] and not seg.mm[info[8] + _DETACHED] and _alive(info[10]):
                if time.monotonic() > deadline:
                    warnings.warn(f"stagewise.CudaIpcRing.close: the peer of ring {self.name!r} did not detach "
                                  f"within {timeout} s; its GPU memory is kept until this process exits")  # fmt: skip
                    _KEPT.append(self._buf)
                    break
                time.sleep(0.001)
        self._slots, self._reserved, self._acquired = [], None, None
        self._buf = None  # freed (creator) or unmapped (peer) once no view holds it
        super().close()

    # ---- writer ----------------------------------------------------------------

    def reserve(self, nbytes: int, timeout: float | None = None) -> torch.Tensor:
        """Wait (host) for a free slot; the current stream waits (GPU) until the reader's GPU released it.
        Returns the slot's first ``nbytes`` bytes as a CUDA uint8 tensor."""
        self._check_nbytes(nbytes)
        if self._reserved is not None:
            raise RuntimeError(f"stagewise.CudaIpcRing.reserve: ring {self.name!r} already has a reserved slot")
        slot = self._wait("reserve", self._reserve_fn, timeout)
        if self._sent >= self.num_slots:  # the slot held message sent - num_slots before
            _ops.cuda_ring_wait(self._buf, self._released, (self._sent - self.num_slots + 1) & 0xFFFFFFFF)
        self._reserved = slot
        return self._slots[slot][:nbytes]

    def commit(self, nbytes: int) -> None:
        """After the current stream's work that filled the slot: mark it ready (GPU) and publish it (host)."""
        if self._reserved is None:
            raise RuntimeError(f"stagewise.CudaIpcRing.commit: ring {self.name!r} has no reserved slot")
        _ops.cuda_ring_signal(self._buf, self._ready, (self._sent + 1) & 0xFFFFFFFF)
        self._commit_fn(self._reserved, nbytes)
        self._reserved = None
        self._sent += 1

    def send(self, tensor: torch.Tensor, timeout: float | None = None) -> None:
        """Copy a contiguous CUDA tensor's bytes into the next slot (on the current stream) and commit."""
        src = tensor.reshape(-1).view(torch.uint8)
        self.reserve(src.numel(), timeout).copy_(src)
        self.commit(src.numel())

    # ---- reader ----------------------------------------------------------------

    def acquire(self, timeout: float | None = None, on_due=None) -> torch.Tensor:
        """Wait (host) for the next message; the current stream waits (GPU) for its bytes. Returns them
        as a CUDA uint8 tensor view of the slot. ``on_due``: as for ShmRing."""
        if self._acquired is not None:
            raise RuntimeError(f"stagewise.CudaIpcRing.acquire: ring {self.name!r} already has an acquired message")
        slot, nbytes = self._acquire_slot(timeout, on_due)
        _ops.cuda_ring_wait(self._buf, self._ready, (self._received + 1) & 0xFFFFFFFF)
        self._acquired = slot
        return self._slots[slot][:nbytes]

    def release(self) -> None:
        """After the current stream's work that read the slot: free it (GPU counter, host ring)."""
        if self._acquired is None:
            raise RuntimeError(f"stagewise.CudaIpcRing.release: ring {self.name!r} has no acquired message")
        _ops.cuda_ring_signal(self._buf, self._released, (self._received + 1) & 0xFFFFFFFF)
        self._release_fn(self._acquired)
        self._acquired = None
        self._received += 1

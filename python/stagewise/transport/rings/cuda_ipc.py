"""Frames between GPU stage processes on one host through a CUDA IPC ring: the ``cuda-ipc``
transport.

UNVERIFIED ON HARDWARE: written and compile-checked without a GPU; its logic is tested on the
CPU with a stand-in ring whose slots are CPU tensors (tests/transport/test_cuda_ipc_logic.py),
its GPU tests (marked ``cuda``) have not run yet.

Like the shm link, a cuda-ipc link is set up on a TCP channel (:mod:`~stagewise.transport.rings.link`):
the sending end creates a :class:`~stagewise.transport.rings.CudaIpcRing` on its GPU and sends the
ring's handle bytes (hex, no pickle); the receiving end maps it. A frame whose tensors are on the
ring's GPU is split in two: its **tensor bytes** go into the next ring slot by device-to-device
copies on the current stream (the ring's stream-ordered counters order them; no host thread waits
for the GPU), at the offsets of the frame's own tensor table; and its **descriptor** — the frame's
header, rows, tensor table and control, flagged as having its payload elsewhere
(:func:`~stagewise.transport.codec.encode_descriptor`) — goes over TCP. The receiver pairs the
k-th descriptor with the k-th slot, enqueues the wait for that slot on its current stream and
decodes the descriptor against the slot (``decode_frame(..., payload=slot)``): every check of a
frame applies, and the tensors are views of the slot, valid until its next ``recv`` (the slot is
released then, after the work already enqueued on the stream). Frames without GPU tensors
(control, tokens) and frames larger than a slot go over TCP whole.

The descriptor's checksum covers the header, tables and control; the tensor bytes in GPU memory
are not checksummed (a checksum would need a copy to the host, which is what the ring avoids).
"""

from __future__ import annotations

import time

import torch

from stagewise.transport.channel import Channel
from stagewise.transport.codec import decode_frame, encode_descriptor, is_descriptor
from stagewise.transport.errors import ChannelClosed, FrameError, HandshakeError
from stagewise.transport.frame import DEFAULT_MAX_PAYLOAD_BYTES, Frame
from stagewise.transport.rings import link
from stagewise.transport.rings.host_ring import RingClosedError
from stagewise.transport.rings.link import RingLink


class CudaIpcChannel(RingLink):
    """One end of a cuda-ipc link. ``ring`` is a :class:`~stagewise.transport.rings.CudaIpcRing`, or
    anything with its methods whose ``slot_device`` and slot views are tensors (tests use CPU ones)."""

    kind = "cuda ipc"

    def __init__(self, tcp: Channel, ring, *, sending: bool, checksum: bool = True, verify_checksum: bool = True,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:  # fmt: skip
        super().__init__(tcp, ring, sending=sending)
        self.checksum, self.verify_checksum, self.max_payload_bytes = checksum, verify_checksum, max_payload_bytes

    @classmethod
    def offer(cls, tcp: Channel, *, slot_bytes: int, num_slots: int = 4, device: int | None = None,
              **options) -> CudaIpcChannel:  # fmt: skip
        """Sending end: allocate the ring on ``device``, send its handle, wait until the peer mapped it."""
        from stagewise.transport.rings.cuda_ipc_ring import CudaIpcRing

        ring = CudaIpcRing.create(CudaIpcRing.unique_name("stagewise-cuda"), slot_bytes, num_slots, device=device)
        try:
            link.offer(tcp, "cuda-ipc", f"cuda ipc ring {ring.name}", handle=ring.handle.hex())
        except BaseException:
            ring.close()
            raise
        return cls(tcp, ring, sending=True, **options)

    @classmethod
    def attach(cls, tcp: Channel, message: dict, *, device: int | None = None, **options) -> CudaIpcChannel:
        """Receiving end, given the sender's ``link`` message: map the ring on ``device``."""
        from stagewise.transport.rings.cuda_ipc_ring import CudaIpcRing

        try:
            ring = CudaIpcRing.attach(bytes.fromhex(str(message["handle"])), device=device, timeout=5.0)
        except (OSError, ValueError, KeyError, RuntimeError) as err:
            link.failed(tcp, str(err))
            raise HandshakeError(f"stagewise.transport: cannot map the cuda ipc ring of {tcp.peer_name}: {err}") \
                from None
        try:
            link.ready(tcp)
        except BaseException:
            ring.close()
            raise
        return cls(tcp, ring, sending=False, **options)

    # ---- data ------------------------------------------------------------------------

    def send(self, frame: Frame, *, timeout: float | None = None) -> None:
        device = self.ring.slot_device
        on_ring = [name for name, t in frame.tensors.items() if t.device == device]
        if not self.sending or not on_ring:
            return self.tcp.send(frame, timeout=timeout)
        if len(on_ring) < len(frame.tensors):
            other = next(name for name in frame.tensors if name not in on_ring)
            raise ValueError(f"stagewise.transport: a cuda-ipc frame with tensors on {device} holds only such "
                             f"tensors; {other!r} is on {frame.tensors[other].device}")  # fmt: skip
        start = time.perf_counter()
        head, spans = encode_descriptor(frame, checksum=self.checksum)
        extent = max(frame.payload_bytes, 1)  # a slot of one byte for a frame of empty tensors
        if extent > self.ring.slot_bytes:
            return self.tcp.send(frame, timeout=timeout)  # too big for a slot: whole over TCP (GPU -> host)
        try:
            slot = self.ring.reserve(extent, timeout)
            for (offset, nbytes), t in zip(spans, frame.tensors.values()):
                if nbytes:
                    slot[offset : offset + nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
            self.ring.commit(extent)
        except RingClosedError as err:
            raise ChannelClosed(f"stagewise.transport: {self.peer_name} is gone ({err})") from None
        self.tcp.send_bytes(head)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(head) + frame.payload_bytes
        self.stats.send_s += time.perf_counter() - start

    def recv(self, timeout: float | None = None, *, max_frame_bytes: int | None = None) -> Frame:
        if self.sending:
            return self.tcp.recv(timeout, max_frame_bytes=max_frame_bytes)
        self._release()  # the previous frame's tensors end here (after the work enqueued on them)
        start = time.perf_counter()
        body = self.tcp.recv_bytes(timeout, max_frame_bytes=max_frame_bytes)
        slot = None
        if is_descriptor(body):
            try:
                slot = self.ring.acquire(None if timeout is None else max(1.0, timeout))
            except RingClosedError as err:
                raise ChannelClosed(f"stagewise.transport: {self.peer_name} closed or died ({err})") from None
            self._held = True
        try:
            frame = decode_frame(body, verify_checksum=self.verify_checksum, max_payload_bytes=self.max_payload_bytes,
                                 copy=False, payload=slot)  # fmt: skip
        except FrameError:
            self.stats.bad_frames += 1
            self._release()
            raise
        self.stats.frames_received += 1
        self.stats.bytes_received += frame.payload_bytes
        self.stats.recv_wait_s += time.perf_counter() - start
        return frame

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.tcp.poll(timeout)

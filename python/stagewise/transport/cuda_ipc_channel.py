"""Frames between GPU stage processes on one host through a CUDA IPC ring: the ``cuda-ipc``
transport.

UNVERIFIED ON HARDWARE: written and compile-checked without a GPU; its tests
(tests/test_cuda_ipc_channel.py, marked ``cuda``) have not run yet.

Like the shm link, a cuda-ipc link is set up on a TCP channel (hello, auth): the sending end
creates a :class:`~stagewise.transport.cuda_ipc.CudaIpcRing` on its GPU and sends the ring's
handle bytes (no pickle); the receiving end maps it. A frame whose tensors are on the GPU is
split in two: its **tensor bytes** go into the next ring slot by device-to-device copies on the
current stream (the ring's stream-ordered counters order them; no host thread waits for the GPU),
and a small **descriptor frame** — the same header, rows and control, each tensor's name, dtype,
shape and offset in the slot — goes over TCP. The receiver pairs the k-th descriptor with the
k-th slot, enqueues the wait for that slot on its current stream and returns tensors that are
views of it, valid until its next ``recv`` (the slot is released then, after the work already
enqueued on the stream). Frames without GPU tensors (control, tokens) go over TCP whole.

The descriptor's checksum covers the header, rows and control; the tensor bytes in GPU memory are
not checksummed (a checksum would need a copy to the host, which is what the ring avoids).
"""

from __future__ import annotations

import time

import torch

from stagewise.transport.channel import Channel
from stagewise.transport.errors import ChannelClosed, FrameError, HandshakeError
from stagewise.transport.frame import Frame, StepKind, WireDType
from stagewise.transport.shm import RingClosedError
from stagewise.transport.shm_channel import RingLink

SETUP_TIMEOUT_S = 30.0
ALIGN = 256


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class CudaIpcChannel(RingLink):
    kind = "cuda ipc"

    @classmethod
    def offer(cls, tcp: Channel, *, slot_bytes: int, num_slots: int = 4, device: int | None = None) -> CudaIpcChannel:
        from stagewise.transport.cuda_ipc import CudaIpcRing

        ring = CudaIpcRing.create(CudaIpcRing.unique_name("stagewise-cuda"), slot_bytes, num_slots, device=device)
        try:
            tcp.send(Frame(step_kind=StepKind.CONTROL, control={
                "op": "link", "transport": "cuda-ipc", "handle": ring.handle.hex()}))
            answer = tcp.recv(timeout=SETUP_TIMEOUT_S).control or {}
            if answer.get("op") != "link-ready":
                raise HandshakeError(f"stagewise.transport: {tcp.peer_name} did not map cuda ipc ring {ring.name}: "
                                     f"{answer.get('error') or answer}")
        except BaseException:
            ring.close()
            raise
        return cls(tcp, ring, sending=True)

    @classmethod
    def attach(cls, tcp: Channel, link: dict, *, device: int | None = None) -> CudaIpcChannel:
        from stagewise.transport.cuda_ipc import CudaIpcRing

        try:
            ring = CudaIpcRing.attach(bytes.fromhex(str(link["handle"])), device=device, timeout=5.0)
        except (OSError, ValueError, KeyError, RuntimeError) as err:
            tcp.send(Frame(step_kind=StepKind.CONTROL, control={"op": "link-failed", "error": str(err)}))
            raise HandshakeError(f"stagewise.transport: cannot map the cuda ipc ring of {tcp.peer_name}: {err}") \
                from None
        tcp.send(Frame(step_kind=StepKind.CONTROL, control={"op": "link-ready"}))
        return cls(tcp, ring, sending=False)

    # ---- data ------------------------------------------------------------------------

    def send(self, frame: Frame, *, timeout: float | None = None) -> None:
        gpu = [(k, t) for k, t in frame.tensors.items() if t.is_cuda]
        if not self.sending or not gpu:
            return self.tcp.send(frame, timeout=timeout)
        start = time.perf_counter()
        table, offset = [], 0
        for name, t in frame.tensors.items():
            if not t.is_cuda:
                raise ValueError(f"stagewise.transport: a cuda-ipc frame holds GPU tensors only; {name!r} is on "
                                 f"{t.device}")
            table.append([name, int(WireDType.from_torch(t.dtype)), list(t.shape), offset])
            offset = _align(offset + t.numel() * t.element_size())
        if offset > self.ring.slot_bytes:
            return self.tcp.send(frame, timeout=timeout)  # too big for a slot: whole over TCP (GPU -> host)
        try:
            slot = self.ring.reserve(max(offset, 1), timeout)
            for (_, t), (_, _, _, off) in zip(frame.tensors.items(), table):
                src = t.contiguous().reshape(-1).view(torch.uint8)
                slot[off : off + src.numel()].copy_(src, non_blocking=True)
            self.ring.commit(max(offset, 1))
        except RingClosedError as err:
            raise ChannelClosed(f"stagewise.transport: {self.peer_name} is gone ({err})") from None
        control = {"ipc": table, "control": frame.control}
        desc = Frame(step_kind=frame.step_kind, request_id=frame.request_id, step_id=frame.step_id,
                     microbatch=frame.microbatch, stage_from=frame.stage_from, stage_to=frame.stage_to,
                     token_index=frame.token_index, rows=frame.rows, control=control)
        self.tcp.send(desc, timeout=timeout)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += offset
        self.stats.send_s += time.perf_counter() - start

    def recv(self, timeout: float | None = None, *, max_frame_bytes: int | None = None) -> Frame:
        if self.sending:
            return self.tcp.recv(timeout, max_frame_bytes=max_frame_bytes)
        self._release()  # the previous frame's tensors end here (after the work enqueued on them)
        start = time.perf_counter()
        desc = self.tcp.recv(timeout, max_frame_bytes=max_frame_bytes)
        control = desc.control or {}
        table = control.get("ipc") if isinstance(control, dict) else None
        if table is None:
            return desc  # a frame without GPU tensors came whole
        try:
            slot = self.ring.acquire(None if timeout is None else max(1.0, timeout))
        except RingClosedError as err:
            raise ChannelClosed(f"stagewise.transport: {self.peer_name} closed or died ({err})") from None
        self._held = True
        tensors = {}
        try:
            for name, code, shape, off in table:
                dtype = WireDType(int(code)).to_torch()
                n = 1
                for d in shape:
                    n *= int(d)
                nbytes = n * dtype.itemsize
                if off < 0 or off + nbytes > slot.numel():
                    raise FrameError("ipc", f"tensor {name!r} at {off}+{nbytes} lies outside the {slot.numel()}-byte slot")
                tensors[str(name)] = slot[off : off + nbytes].view(dtype).reshape([int(d) for d in shape])
        except (ValueError, TypeError) as err:
            self.stats.bad_frames += 1
            raise FrameError("ipc", f"bad tensor table from {self.peer_name}: {err}") from None
        self.stats.frames_received += 1
        self.stats.recv_wait_s += time.perf_counter() - start
        return Frame(step_kind=desc.step_kind, request_id=desc.request_id, step_id=desc.step_id,
                     microbatch=desc.microbatch, stage_from=desc.stage_from, stage_to=desc.stage_to,
                     token_index=desc.token_index, rows=desc.rows, tensors=tensors, control=control.get("control"),
                     payload_bytes=sum(t.numel() * t.element_size() for t in tensors.values()))

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.tcp.poll(timeout)


def open_channel(**options) -> Channel:
    """``stagewise.transport.open_channel("cuda-ipc", ...)``: see
    :func:`stagewise.transport.shm_channel.open_link`."""
    from stagewise.transport.shm_channel import open_link

    if not torch.cuda.is_available():
        raise RuntimeError("stagewise.transport: the cuda-ipc transport needs a CUDA device; none is available")
    return open_link("cuda-ipc", **options)

"""Frames over torch.distributed point-to-point (gloo on CPUs, NCCL on GPUs), for clusters that
already run a process group.

Each frame is a fixed-size int64 "sizes" message (head bytes, number of tensors, each tensor's
bytes), then the head (header, tables, control) as a uint8 tensor, then each tensor's bytes as a
uint8 view of its own memory. Because the sizes message says how many messages follow and how
large they are, the receiver always consumes a frame whole: a frame that fails to decode raises
FrameError and the channel stays usable. A sizes message that is itself impossible (more tensors
than a frame holds, above the size limit) closes the channel.

The receiver rebuilds the frame's canonical bytes in one buffer and decodes it with
``copy=False``, so the checksum and every check of :func:`decode_frame` apply unchanged.
With NCCL the messages are staged through device memory (one copy each way on each side) and
the received tensors are CPU tensors; a path that receives straight into GPU tensors is future
work (within a host, the cuda-ipc ring is the fast path).
"""

from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

from stagewise.transport.channel import Channel, ChannelStats, describe_peer
from stagewise.transport.codec import ALIGN, decode_frame, encode_parts
from stagewise.transport.errors import ChannelClosed, FrameError, HandshakeError
from stagewise.transport.frame import DEFAULT_MAX_PAYLOAD_BYTES, MAX_TENSORS, Frame
from stagewise.transport.hello import HELLO_MAX_BYTES, Hello, handshake

_SIZES = 2 + MAX_TENSORS


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class TorchChannel(Channel):
    def __init__(self, peer_rank: int, *, group=None, tag: int = 0, checksum: bool = True,
                 verify_checksum: bool = True, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:  # fmt: skip
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("stagewise.transport: the torch transport needs an initialised torch.distributed process group")
        self.rank, self.peer_rank, self.group, self.tag = dist.get_rank(), peer_rank, group, tag
        if peer_rank == self.rank or not 0 <= peer_rank < dist.get_world_size(group):
            raise ValueError(f"stagewise.transport: peer_rank must be another rank in [0, {dist.get_world_size(group)}), got {peer_rank}")
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.checksum, self.verify_checksum, self.max_payload_bytes = checksum, verify_checksum, max_payload_bytes
        self.peer_name = self._base = f"rank {peer_rank}"
        self._closed_why: str | None = None
        self._start_receiver()

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device)

    def send(self, frame: Frame, *, timeout: float | None = None) -> None:
        head, parts = encode_parts(frame, checksum=self.checksum)
        self._send_parts(head, parts)

    def send_bytes(self, data) -> None:
        """Send an already encoded frame (or, in tests, any bytes) as the head of a frame."""
        self._send_parts(bytearray(data), [])

    def _send_parts(self, head: bytearray, parts: list) -> None:
        self._check_open()
        t0 = time.perf_counter()
        # parts: memoryviews of tensor bytes, and bytes objects for the alignment padding
        data = [torch.frombuffer(p, dtype=torch.uint8) for p in parts if isinstance(p, memoryview)]
        sizes = torch.zeros(_SIZES, dtype=torch.int64)
        sizes[0], sizes[1] = len(head), len(data)
        for i, d in enumerate(data):
            sizes[2 + i] = d.numel()
        msgs = [sizes, torch.frombuffer(head, dtype=torch.uint8), *data]
        try:
            works = [dist.isend(self._dev(m), self.peer_rank, group=self.group, tag=self.tag) for m in msgs]
            for w in works:
                w.wait()
        except RuntimeError as e:
            raise self._lost(e) from None
        self.stats.frames_sent += 1
        self.stats.bytes_sent += len(head) + sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        self.stats.send_s += time.perf_counter() - t0

    # -- receiving: a thread does the blocking receives (a gloo receive that times out tears the
    # pair down, so timeouts are taken on the queue instead); the queue's bound is back-pressure.
    def _start_receiver(self) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._peeked = None
        threading.Thread(target=self._receive_loop, name=f"stagewise-recv-{self.peer_name}", daemon=True).start()

    def _receive_loop(self) -> None:
        count = 0
        while True:
            try:
                limit = HELLO_MAX_BYTES if count < 2 else None  # the two hello frames every side receives
                self._queue.put(self._receive_one(limit))
                count += 1
            except FrameError as e:
                self._queue.put(e)
                if e.field.startswith("record."):
                    return
            except ChannelClosed as e:
                self._queue.put(e)
                return

    def _receive_one(self, max_frame_bytes: int | None) -> tuple[Frame, int]:
        sizes = torch.empty(_SIZES, dtype=torch.int64, device=self.device)
        try:
            dist.recv(sizes, self.peer_rank, group=self.group, tag=self.tag)
        except RuntimeError as e:
            raise self._lost(e) from None
        sizes = sizes.cpu().tolist()
        head_len, n, lengths = sizes[0], sizes[1], sizes[2 : 2 + max(0, min(sizes[1], MAX_TENSORS))]
        limit = max_frame_bytes or self.max_payload_bytes + (64 << 20)
        if not 0 <= n <= MAX_TENSORS or head_len < 0 or min(lengths, default=0) < 0 or head_len + sum(lengths) > limit:
            self._closed_why = "an impossible sizes message"
            raise FrameError("record.length", f"sizes message from {self.peer_name} describes {n} tensors / "
                                              f"{head_len + sum(lengths)} bytes (limit {limit}); closing the channel")  # fmt: skip
        buf = self._recv_into_frame(head_len, lengths)
        payload_limit = self.max_payload_bytes if max_frame_bytes is None else min(self.max_payload_bytes, max_frame_bytes)
        frame = decode_frame(buf, verify_checksum=self.verify_checksum, max_payload_bytes=payload_limit, copy=False)
        return frame, buf.numel()

    def recv(self, timeout: float | None = None, *, max_frame_bytes: int | None = None) -> Frame:
        t0 = time.perf_counter()
        try:
            if self._peeked is not None:
                item, self._peeked = self._peeked, None
            else:
                if self._closed_why is not None and self._queue.empty():
                    self._check_open()
                try:
                    item = self._queue.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(f"stagewise.transport: recv from {self.peer_name} timed out") from None
            if isinstance(item, FrameError):
                self.stats.bad_frames += 1
                raise item
            if isinstance(item, Exception):
                raise item
            frame, nbytes = item
            self.stats.frames_received += 1
            self.stats.bytes_received += nbytes
            return frame
        finally:
            self.stats.recv_wait_s += time.perf_counter() - t0

    def _recv_into_frame(self, head_len: int, lengths: list[int]) -> torch.Tensor:
        """The frame's canonical bytes: head, then each tensor at its 64-aligned offset, zero gaps."""
        spans, off = [], 0
        for length in lengths:
            off = _align(off)
            spans.append((head_len + off, length))
            off += length
        buf = torch.empty(head_len + off, dtype=torch.uint8)
        end = head_len
        for start, length in spans:
            buf[end:start].zero_()
            end = start + length
        targets = [buf[:head_len]] + [buf[s : s + n] for s, n in spans if n]
        try:
            if self.device.type == "cpu":
                for t in targets:
                    dist.recv(t, self.peer_rank, group=self.group, tag=self.tag)
            else:
                for t in targets:
                    staged = torch.empty(t.numel(), dtype=torch.uint8, device=self.device)
                    dist.recv(staged, self.peer_rank, group=self.group, tag=self.tag)
                    t.copy_(staged)
        except RuntimeError as e:
            raise self._lost(e) from None
        return buf

    def poll(self, timeout: float | None = 0.0) -> bool:
        if self._peeked is None:
            try:
                self._peeked = self._queue.get(timeout=timeout) if timeout != 0 else self._queue.get_nowait()
            except queue.Empty:
                return self._closed_why is not None
        return True

    def _lost(self, err: Exception) -> ChannelClosed:
        self._closed_why = f"lost ({type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''})"
        return ChannelClosed(f"stagewise.transport: connection to {self.peer_name} {self._closed_why}")

    def _check_open(self) -> None:
        if self._closed_why is not None:
            raise ChannelClosed(f"stagewise.transport: channel to {self.peer_name} is closed: {self._closed_why}")

    def close(self) -> None:
        # A posted irecv cannot be withdrawn from a process group; it is left to the group's teardown.
        if self._closed_why is None:
            self._closed_why = "closed by this side"

    @property
    def closed(self) -> bool:
        return self._closed_why is not None


def open_channel(peer_rank: int, *, hello: Hello, auth_token=None, initiator: bool | None = None, group=None,
                 tag: int = 0, timeout: float | None = 60.0, checksum: bool = True, verify_checksum: bool = True,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> TorchChannel:  # fmt: skip
    """A channel to ``peer_rank`` after the hello (the lower rank initiates unless told)."""
    ch = TorchChannel(peer_rank, group=group, tag=tag, checksum=checksum, verify_checksum=verify_checksum,
                      max_payload_bytes=max_payload_bytes)  # fmt: skip
    if initiator is None:
        initiator = ch.rank < peer_rank
    me = f"rank {ch.rank}"
    try:
        peer = handshake(ch, hello, initiator=initiator, auth_token=auth_token, timeout=timeout,
                         local_name=me, peer_name=ch.peer_name)  # fmt: skip
    except (HandshakeError, ChannelClosed):
        ch.close()
        raise
    ch.peer, ch.peer_name = peer, describe_peer(ch._base, peer)
    ch.stats = ChannelStats()  # count the run's frames, not the hello's
    return ch

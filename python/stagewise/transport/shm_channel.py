"""Frames over a shared-memory ring: the ``shm`` transport between stages on one host.

A shm link is set up on a TCP channel (which did the hello and authentication): the sending
end creates a :class:`~stagewise.transport.shm.ShmRing`, names it over TCP, and the receiving
end attaches (which removes the name from ``/dev/shm``). Frames then go into ring slots with one
copy (:func:`~stagewise.transport.codec.prepare_frame`) and are decoded in place: the
receiver's tensors are **views of the slot**, valid until its next ``recv`` (the slot is
released then). A frame larger than a slot goes over the TCP channel, announced by a marker in
the ring so that order is kept. The TCP channel stays open beside the ring: the reverse
direction uses it, and its EOF, like the ring's own check, tells that the peer is gone.
"""

from __future__ import annotations

import time

from stagewise.transport.channel import Channel
from stagewise.transport.codec import decode_frame, prepare_frame
from stagewise.transport.errors import ChannelClosed, HandshakeError
from stagewise.transport.frame import DEFAULT_MAX_PAYLOAD_BYTES, Frame, StepKind
from stagewise.transport.shm import RingClosedError, ShmRing

BIG_FRAME = b"SWBIG"
"""A ring message saying: the next frame comes over the TCP channel (it did not fit a slot)."""
SETUP_TIMEOUT_S = 30.0


class RingLink(Channel):
    """A data link of two parts: a ring (shm or CUDA IPC) carrying frames from the sending end
    to the receiving end, and the TCP channel it was set up on (hello, auth, peer death, the
    reverse direction). The receiving end holds at most one slot, released by :meth:`_release`."""

    kind = "ring"

    def __init__(self, tcp: Channel, ring, *, sending: bool) -> None:
        super().__init__()
        self.tcp, self.ring, self.sending = tcp, ring, sending
        self.peer, self.peer_name = tcp.peer, f"{tcp.peer_name} ({self.kind} ring {ring.name})"
        self._held = False

    def _release(self) -> None:
        if self._held:
            self._held = False
            self.ring.release()

    def close(self) -> None:
        try:
            self._release()
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self.ring.close()
        self.tcp.close()

    @property
    def closed(self) -> bool:
        return self.ring.closed or self.tcp.closed


class ShmChannel(RingLink):
    """One end of a shm link: the ring carries frames from the sending end to the receiving end;
    the underlying TCP channel carries the setup, oversized frames and the reverse direction."""

    kind = "shm"

    def __init__(self, tcp: Channel, ring: ShmRing, *, sending: bool, checksum: bool = True,
                 verify_checksum: bool = True, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        super().__init__(tcp, ring, sending=sending)
        self.checksum, self.verify_checksum, self.max_payload_bytes = checksum, verify_checksum, max_payload_bytes
        self._pending = None  # a slot acquired by poll(), not yet returned by recv()

    # ---- setup ---------------------------------------------------------------------

    @classmethod
    def offer(cls, tcp: Channel, *, slot_bytes: int, num_slots: int = 4, **options) -> ShmChannel:
        """Sending end: create the ring, name it to the peer, wait until it attached."""
        ring = ShmRing.create(ShmRing.unique_name("stagewise"), slot_bytes, num_slots)
        try:
            tcp.send(Frame(step_kind=StepKind.CONTROL, control={
                "op": "link", "transport": "shm", "name": ring.name, "slot_bytes": slot_bytes,
                "num_slots": num_slots}))
            answer = tcp.recv(timeout=SETUP_TIMEOUT_S).control or {}
            if answer.get("op") != "link-ready":
                raise HandshakeError(f"stagewise.transport: {tcp.peer_name} did not attach shm ring {ring.name}: "
                                     f"{answer.get('error') or answer}")
        except BaseException:
            ring.close()
            raise
        return cls(tcp, ring, sending=True, **options)

    @classmethod
    def attach(cls, tcp: Channel, link: dict, **options) -> ShmChannel:
        """Receiving end, given the sender's ``link`` message."""
        try:
            ring = ShmRing.attach(str(link["name"]), timeout=5.0)
        except (OSError, ValueError, KeyError) as err:
            tcp.send(Frame(step_kind=StepKind.CONTROL, control={"op": "link-failed", "error": str(err)}))
            raise HandshakeError(f"stagewise.transport: cannot attach the shm ring of {tcp.peer_name}: {err}") \
                from None
        tcp.send(Frame(step_kind=StepKind.CONTROL, control={"op": "link-ready"}))
        return cls(tcp, ring, sending=False, **options)

    # ---- data ------------------------------------------------------------------------

    def send(self, frame: Frame, *, timeout: float | None = None) -> None:
        if not self.sending:
            return self.tcp.send(frame, timeout=timeout)
        start = time.perf_counter()
        prepared = prepare_frame(frame, checksum=self.checksum)
        n = prepared.nbytes
        try:
            if n <= self.ring.slot_bytes:
                view = self.ring.reserve(n, timeout)
                try:
                    prepared.write(view)
                except BaseException:
                    self.ring.commit(0)  # give the slot back empty; the reader skips it
                    raise
                self.ring.commit(n)
            else:
                self.ring.send(BIG_FRAME, timeout)
                self.tcp.send(frame, timeout=timeout)
        except RingClosedError as err:
            raise ChannelClosed(f"stagewise.transport: {self.peer_name} is gone ({err})") from None
        self.stats.frames_sent += 1
        self.stats.bytes_sent += n
        self.stats.send_s += time.perf_counter() - start

    def recv(self, timeout: float | None = None, *, max_frame_bytes: int | None = None) -> Frame:
        if self.sending:
            return self.tcp.recv(timeout, max_frame_bytes=max_frame_bytes)
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        view = self._next(deadline)
        self.stats.recv_wait_s += time.perf_counter() - start
        self._held = True
        if len(view) == len(BIG_FRAME) and view == BIG_FRAME:
            self._release()
            frame = self.tcp.recv(None if deadline is None else max(1.0, deadline - time.perf_counter()),
                                  max_frame_bytes=max_frame_bytes)
        else:
            try:
                frame = decode_frame(view, verify_checksum=self.verify_checksum,
                                     max_payload_bytes=self.max_payload_bytes, copy=False)
            except Exception:
                self.stats.bad_frames += 1
                self._release()
                raise
        self.stats.frames_received += 1
        self.stats.bytes_received += frame.payload_bytes
        return frame

    def _next(self, deadline: float | None) -> memoryview:
        """The next non-empty slot (releasing the previous frame's slot first)."""
        if self._pending is not None:
            view, self._pending = self._pending, None
            return view
        self._release()  # the previous frame's tensors end here
        while True:
            try:
                view = self.ring.acquire(None if deadline is None else max(0.0, deadline - time.perf_counter()))
            except RingClosedError as err:
                raise ChannelClosed(f"stagewise.transport: {self.peer_name} closed or died ({err})") from None
            if len(view) == 0:  # a slot the sender gave back empty
                self.ring.release()
                continue
            return view

    def poll(self, timeout: float | None = 0.0) -> bool:
        """True when a frame is ready. On the receiving end this ends the previous frame's
        tensors, as ``recv`` does."""
        if self.sending:
            return self.tcp.poll(timeout)
        if self._pending is not None:
            return True
        try:
            self._pending = self._next(None if timeout is None else time.perf_counter() + timeout)
        except TimeoutError:
            return False
        except ChannelClosed:
            return True  # recv raises it
        self._held = True
        return True


# ---- the link message: which transport a freshly opened data link continues on ------------

LINK_TRANSPORTS = ("tcp", "shm", "cuda-ipc")


def upgrade_dialled(channel: Channel, transport: str, *, slot_bytes: int = 1 << 20, num_slots: int = 4,
                    device: int | None = None, **options) -> Channel:
    """On the dialling end of a TCP channel (after its hello): name the data transport in a
    ``link`` message; ``shm`` returns a :class:`ShmChannel` (frames sent by this end go through
    the ring), ``cuda-ipc`` a :class:`~stagewise.transport.cuda_ipc_channel.CudaIpcChannel` (GPU
    tensors through a ring in ``device``'s memory), ``tcp`` the channel itself."""
    if transport not in LINK_TRANSPORTS:
        raise ValueError(f"stagewise.transport: a link continues on one of {LINK_TRANSPORTS}, got {transport!r}")
    if transport == "shm":
        return ShmChannel.offer(channel, slot_bytes=slot_bytes, num_slots=num_slots, **options)
    if transport == "cuda-ipc":
        from stagewise.transport.cuda_ipc_channel import CudaIpcChannel

        return CudaIpcChannel.offer(channel, slot_bytes=slot_bytes, num_slots=num_slots, device=device)
    channel.send(Frame(step_kind=StepKind.CONTROL, control={"op": "link", "transport": "tcp"}))
    answer = channel.recv(timeout=SETUP_TIMEOUT_S).control or {}
    if answer.get("op") != "link-ready":
        raise HandshakeError(f"stagewise.transport: {channel.peer_name} refused the tcp link: {answer}")
    return channel


def upgrade_accepted(channel: Channel, *, device: int | None = None, **options) -> Channel:
    """On the accepting end: read the dialler's ``link`` message and continue on its transport
    (a cuda-ipc ring is mapped on ``device``)."""
    link = channel.recv(timeout=SETUP_TIMEOUT_S).control or {}
    if link.get("op") != "link" or link.get("transport") not in LINK_TRANSPORTS:
        raise HandshakeError(f"stagewise.transport: {channel.peer_name}: expected a link message naming one of "
                             f"{LINK_TRANSPORTS}, got {link}")
    if link["transport"] == "shm":
        return ShmChannel.attach(channel, link, **options)
    if link["transport"] == "cuda-ipc":
        from stagewise.transport.cuda_ipc_channel import CudaIpcChannel

        return CudaIpcChannel.attach(channel, link, device=device)
    channel.send(Frame(step_kind=StepKind.CONTROL, control={"op": "link-ready"}))
    return channel


def open_link(kind: str, *, hello, host=None, port=None, listener=None, auth_token=None, timeout: float = 30.0,
              slot_bytes: int = 1 << 20, num_slots: int = 4, device: int | None = None, **options) -> Channel:
    """A ring link of ``kind`` (shm, cuda-ipc) over TCP: connect to ``host:port`` (then this end
    sends through the ring) or accept on ``listener`` (this end receives)."""
    from stagewise.transport import tcp

    checks = {k: options[k] for k in ("checksum", "verify_checksum") if k in options}
    if listener is not None:
        return upgrade_accepted(listener.accept(timeout), device=device, **checks)
    if host is None or port is None:
        raise ValueError(f"stagewise.transport: open_channel({kind!r}) needs host and port to connect, or listener= "
                         "to accept")
    channel = tcp.connect(host, port, hello=hello, auth_token=auth_token, timeout=timeout, **options)
    try:
        return upgrade_dialled(channel, kind, slot_bytes=slot_bytes, num_slots=num_slots, device=device, **checks)
    except BaseException:
        channel.close()
        raise


def open_channel(**options) -> Channel:
    """``stagewise.transport.open_channel("shm", ...)``: see :func:`open_link`."""
    return open_link("shm", **options)

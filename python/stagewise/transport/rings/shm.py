"""Frames over a shared-memory ring: the ``shm`` transport between stages on one host.

A shm link is set up on a TCP channel (:mod:`~stagewise.transport.rings.link`): the sending end
creates a :class:`~stagewise.transport.rings.ShmRing`, names it in the link message, and the
receiving end attaches (which removes the name from ``/dev/shm``). Frames then go into ring slots
with one copy (:func:`~stagewise.transport.codec.prepare_frame`) and are decoded in place: the
receiver's tensors are **views of the slot**, valid until its next ``recv`` (the slot is released
then). A frame larger than a slot goes over the TCP channel, announced by a marker in the ring so
that order is kept. The TCP channel stays open beside the ring: the reverse direction uses it,
and its EOF, like the ring's own check, tells that the peer is gone. With ``warm`` set, the
receiver runs its handling of the last small frame again when the next is due
(:attr:`~stagewise.transport.channel.Channel.warm`).
"""

from __future__ import annotations

import time

from stagewise.transport.channel import Channel
from stagewise.transport.codec import decode_frame, prepare_frame
from stagewise.transport.errors import ChannelClosed, HandshakeError
from stagewise.transport.frame import DEFAULT_MAX_PAYLOAD_BYTES, Frame
from stagewise.transport.rings import link
from stagewise.transport.rings.host_ring import RingClosedError
from stagewise.transport.rings.link import RingLink
from stagewise.transport.rings.shm_ring import ShmRing

WARM_BYTES = 64 << 10
"""Frames up to this size are kept (copied) for warming the receiving path; a decode step's is a
few KB, a prompt's larger and not worth the copy."""
BIG_FRAME = b"SWBIG"
"""A ring message saying: the next frame comes over the TCP channel (it did not fit a slot)."""


class ShmChannel(RingLink):
    """One end of a shm link: the ring carries frames from the sending end to the receiving end;
    the underlying TCP channel carries the setup, oversized frames and the reverse direction."""

    kind = "shm"

    def __init__(self, tcp: Channel, ring: ShmRing, *, sending: bool, checksum: bool = True,
                 verify_checksum: bool = True, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        super().__init__(tcp, ring, sending=sending)
        self.checksum, self.verify_checksum, self.max_payload_bytes = checksum, verify_checksum, max_payload_bytes
        self._pending = None  # a slot acquired by poll(), not yet returned by recv()
        self._last: bytearray | None = None  # the last small frame's bytes, for warm()

    # ---- setup ---------------------------------------------------------------------

    @classmethod
    def offer(cls, tcp: Channel, *, slot_bytes: int, num_slots: int = 4, device: int | None = None,
              **options) -> ShmChannel:  # fmt: skip
        """Sending end: create the ring, name it to the peer, wait until it attached (``device``:
        not used, the ring is in host memory)."""
        ring = ShmRing.create(ShmRing.unique_name("stagewise"), slot_bytes, num_slots)
        try:
            link.offer(tcp, "shm", f"shm ring {ring.name}", name=ring.name, slot_bytes=slot_bytes,
                       num_slots=num_slots)  # fmt: skip
        except BaseException:
            ring.close()
            raise
        return cls(tcp, ring, sending=True, **options)

    @classmethod
    def attach(cls, tcp: Channel, message: dict, *, device: int | None = None, **options) -> ShmChannel:
        """Receiving end, given the sender's ``link`` message (``device``: not used)."""
        try:
            ring = ShmRing.attach(str(message["name"]), timeout=5.0)
        except (OSError, ValueError, KeyError) as err:
            link.failed(tcp, str(err))
            raise HandshakeError(f"stagewise.transport: cannot attach the shm ring of {tcp.peer_name}: {err}") \
                from None
        try:
            link.ready(tcp)
        except BaseException:
            ring.close()
            raise
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
            if self.warm is not None and len(view) <= WARM_BYTES:
                self._last = bytearray(view)
        self.stats.frames_received += 1
        self.stats.bytes_received += frame.payload_bytes
        return frame

    def _next(self, deadline: float | None) -> memoryview:
        """The next non-empty slot (releasing the previous frame's slot first)."""
        if self._pending is not None:
            view, self._pending = self._pending, None
            return view
        self._release()  # the previous frame's tensors end here
        on_due = None if self.warm is None or self._last is None else self._warm
        while True:
            try:
                view = self.ring.acquire(None if deadline is None else max(0.0, deadline - time.perf_counter()),
                                         on_due=on_due)
            except RingClosedError as err:
                raise ChannelClosed(f"stagewise.transport: {self.peer_name} closed or died ({err})") from None
            if len(view) == 0:  # a slot the sender gave back empty
                self.ring.release()
                continue
            return view

    def _warm(self) -> None:
        """The next frame is due: run the receiving path on the last one's bytes (decode, then the
        owner's ``warm``), which a stage's step left cold in the caches. A frame the owner refuses
        is not warmed again."""
        try:
            self.warm(decode_frame(memoryview(self._last), verify_checksum=self.verify_checksum,
                                   max_payload_bytes=self.max_payload_bytes, copy=False))
        except Exception:  # noqa: BLE001 - the frame itself was refused when it came; warming is optional
            self._last = None

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

"""A ring link, and the ``link`` message that sets a data link up on a TCP channel.

A data link between two stages is first a TCP channel (which did the hello and the
authentication). Its dialling end then sends one ``link`` message naming the transport its
frames continue on; for a ring, the message also names the ring (a shared-memory name or a CUDA
IPC handle), the accepting end attaches to it and answers ``link-ready`` (or ``link-failed``
with the reason). From then on frames from the dialling end go through the ring; the TCP channel
stays open beside it for the reverse direction, for frames too large for a slot, and because its
EOF tells that the peer is gone. On ``tcp`` (:class:`TcpLink`) the TCP channel itself carries them.

The messages are CONTROL frames: ``{"op": "link", "transport": NAME, ...}`` (a link transport of
:mod:`stagewise.transport.registry`), ``{"op": "link-ready"}``, ``{"op": "link-failed", "error": reason}``.
"""

from __future__ import annotations

from stagewise.transport.channel import Channel
from stagewise.transport.errors import HandshakeError
from stagewise.transport.frame import Frame, StepKind

SETUP_TIMEOUT_S = 30.0
"""How long either end waits for the other's link message or answer."""


def offer(tcp: Channel, transport: str, what: str, **fields) -> None:
    """Dialling end: send the ``link`` message and wait for ``link-ready``; HandshakeError (naming
    ``what``, e.g. "shm ring NAME", and the peer's reason) otherwise."""
    tcp.send(Frame(step_kind=StepKind.CONTROL, control={"op": "link", "transport": transport, **fields}))
    answer = tcp.recv(timeout=SETUP_TIMEOUT_S).control or {}
    if answer.get("op") != "link-ready":
        raise HandshakeError(f"stagewise.transport: {tcp.peer_name} did not take {what}: {answer.get('error') or answer}")


def read(tcp: Channel, transports: tuple[str, ...]) -> dict:
    """Accepting end: the dialler's ``link`` message, naming one of ``transports``."""
    link = tcp.recv(timeout=SETUP_TIMEOUT_S).control or {}
    if link.get("op") != "link" or link.get("transport") not in transports:
        raise HandshakeError(f"stagewise.transport: {tcp.peer_name}: expected a link message naming one of "
                             f"{transports}, got {link}")  # fmt: skip
    return link


def ready(tcp: Channel) -> None:
    """Accepting end: the link is set up."""
    tcp.send(Frame(step_kind=StepKind.CONTROL, control={"op": "link-ready"}))


def failed(tcp: Channel, why: str) -> None:
    """Accepting end: the link could not be set up (the dialler raises with ``why``)."""
    tcp.send(Frame(step_kind=StepKind.CONTROL, control={"op": "link-failed", "error": why}))


class TcpLink:
    """The ``tcp`` transport's setup (:class:`~stagewise.transport.registry.LinkSetup`): the link
    message names tcp, and the TCP channel itself carries the frames from then on."""

    @classmethod
    def offer(cls, tcp: Channel, *, slot_bytes: int = 0, num_slots: int = 0, device: int | None = None,
              checksum: bool = True, verify_checksum: bool = True) -> Channel:  # fmt: skip
        """Dialling end (the channel's checksum settings are its own, from its connect)."""
        offer(tcp, "tcp", "the tcp link")
        return tcp

    @classmethod
    def attach(cls, tcp: Channel, message: dict, *, device: int | None = None, checksum: bool = True,
               verify_checksum: bool = True) -> Channel:  # fmt: skip
        """Accepting end."""
        ready(tcp)
        return tcp


class RingLink(Channel):
    """A data link of two parts: a ring carrying frames from the sending end to the receiving
    end, and the TCP channel it was set up on (hello, auth, peer death, the reverse direction,
    oversized frames). The receiving end holds at most one slot at a time: the one whose views the
    last frame returned, released by the next ``recv`` (or ``close``)."""

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

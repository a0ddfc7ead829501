"""The interface every transport implements (tcp, torch, and the shared-memory rings)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

from stagewise.transport.frame import Frame
from stagewise.transport.hello import Hello


@dataclass(slots=True)
class ChannelStats:
    frames_sent: int = 0
    bytes_sent: int = 0
    """Encoded frame bytes (transport framing not counted)."""
    frames_received: int = 0
    bytes_received: int = 0
    bad_frames: int = 0
    """Frames rejected with FrameError."""
    send_s: float = 0.0
    """Seconds spent inside send (encoding, checksum, copying, waiting for buffer space)."""
    recv_wait_s: float = 0.0
    """Seconds spent inside recv (waiting for and reading frames, checksum, decoding)."""


class Channel(abc.ABC):
    """A bidirectional, ordered stream of frames with one peer, opened by a hello exchange.

    ``send`` and ``recv`` may be called from two different threads at once (one each)."""

    peer: Hello | None = None
    """The peer's hello (its stage indices, role, fingerprint)."""
    peer_name: str = "the peer"
    """The peer in messages: its address or rank and, after the hello, its stage indices."""
    warm: Callable[[Frame], object] | None = None
    """The receiver's own handling of a frame, run on a copy of the last small frame received
    when the next one is due, so that its code and data are in the caches when it comes (a link
    that paces its waits calls it: the shm ring; others never). It must change nothing."""

    def __init__(self) -> None:
        self.stats = ChannelStats()

    @abc.abstractmethod
    def send(self, frame: Frame, *, timeout: float | None = None) -> None:
        """Encode and send one frame. Raises ChannelClosed if the peer is gone, TimeoutError if
        the frame could not be handed over in ``timeout`` seconds (the channel is then closed:
        part of the frame may have gone out)."""

    @abc.abstractmethod
    def recv(self, timeout: float | None = None, *, max_frame_bytes: int | None = None) -> Frame:
        """The next frame. Raises TimeoutError (nothing lost: the next call resumes),
        ChannelClosed (EOF, naming the peer) or FrameError (that frame is dropped)."""

    @abc.abstractmethod
    def poll(self, timeout: float | None = 0.0) -> bool:
        """True when a frame has started to arrive (recv will not wait for the peer to send)."""

    @abc.abstractmethod
    def close(self) -> None: ...

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    def fileno(self) -> int:
        """A file descriptor that turns readable when a frame arrives, for ``selectors``."""
        raise NotImplementedError(f"{type(self).__name__} has no file descriptor; use poll()")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} to {self.peer_name}{' closed' if self.closed else ''}>"


def describe_peer(base: str, hello: Hello | None) -> str:
    if hello is None:
        return base
    return f"{base} (stage {hello.stage_from} -> {hello.stage_to}, role {hello.role!r})"

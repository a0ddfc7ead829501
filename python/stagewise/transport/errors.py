"""Errors of the transport layer. Torch-free, so that `stagewise.FrameError` stays cheap to name."""

from __future__ import annotations


class FrameError(ValueError):
    """A frame that cannot be accepted. ``field`` names the header field, table or section at fault
    (``"magic"``, ``"checksum"``, ``"rows[2].num_tokens"``, ``"tensors[0].shape"``, ``"record.length"``...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"stagewise.transport: bad frame: {field}: {message}")
        self.field = field


class HandshakeError(ConnectionError):
    """The hello exchange failed: version, stage indices, role or fingerprint differ, or the
    authentication token is missing or wrong. The message names both sides' values."""


class HelloTimeout(HandshakeError):
    """The peer took the connection but sent no hello in time: a busy peer (loading its layers on
    loaded cores, say), which a caller may dial again; not a refusal."""


class ChannelClosed(ConnectionError):
    """The channel is closed: the peer closed it or died (EOF), or this side closed it."""

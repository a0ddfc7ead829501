"""How stages talk: the frame codec, the hello, and the channels that carry frames.

- :mod:`~stagewise.transport.frame` / :mod:`~stagewise.transport.codec`: what a frame holds and its bytes
  (``docs/wire-format.md``; the constants in :mod:`~stagewise.transport.wire`), independent of any socket;
- :mod:`~stagewise.transport.hello`: the hello and the HMAC challenge-response that open a connection;
- :mod:`~stagewise.transport.tcp`, :mod:`~stagewise.transport.torch_dist`: channels;
- :mod:`~stagewise.transport.rings`: the shared-memory and CUDA IPC rings, and the ``link`` message
  that moves a dialled TCP channel's frames onto one;
- :mod:`~stagewise.transport.registry`: every transport once (its name, what a hop needs to use it,
  what sets a channel up on it) and the one rule that resolves ``auto``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagewise.transport.channel import Channel, ChannelStats
    from stagewise.transport.codec import decode_frame, encode_frame, encode_frame_into, encode_parts, frame_nbytes
    from stagewise.transport.errors import ChannelClosed, FrameError, HandshakeError
    from stagewise.transport.frame import DEFAULT_MAX_PAYLOAD_BYTES, Frame, Layout, Row, RowFlags, StepKind, WireDType
    from stagewise.transport.hello import Hello

# Loaded on first use, so that the light modules (registry, errors) import without torch or the
# extension: the CLI and the run-plan parser name transports without loading either.
_EXPORTS = {
    "Channel": "channel", "ChannelStats": "channel", "decode_frame": "codec", "encode_frame": "codec",
    "encode_frame_into": "codec", "encode_parts": "codec", "frame_nbytes": "codec", "ChannelClosed": "errors",
    "FrameError": "errors", "HandshakeError": "errors", "DEFAULT_MAX_PAYLOAD_BYTES": "frame", "Frame": "frame",
    "Layout": "frame", "Row": "frame", "RowFlags": "frame", "StepKind": "frame", "WireDType": "frame", "Hello": "hello",
}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"stagewise.transport.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'stagewise.transport' has no attribute {name!r}")

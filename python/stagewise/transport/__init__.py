"""How stages talk: the frame codec (seed 000 §3), the hello, and the channels that carry frames.

- :mod:`~stagewise.transport.frame` / :mod:`~stagewise.transport.codec`: what a frame holds and its bytes
  (``docs/wire-format.md``), independent of any socket;
- :mod:`~stagewise.transport.hello`: the hello and the HMAC challenge-response that open a connection;
- :mod:`~stagewise.transport.tcp`, :mod:`~stagewise.transport.torch_dist`: channels;
- :func:`open_channel`: pick a transport per hop (tcp | shm | cuda-ipc | torch | auto).
"""

from __future__ import annotations

from stagewise.transport.channel import Channel, ChannelStats
from stagewise.transport.codec import decode_frame, encode_frame, encode_frame_into, encode_parts, frame_nbytes
from stagewise.transport.errors import ChannelClosed, FrameError, HandshakeError
from stagewise.transport.frame import DEFAULT_MAX_PAYLOAD_BYTES, Frame, Layout, Row, RowFlags, StepKind, WireDType
from stagewise.transport.hello import Hello
from stagewise.transport.registry import open_channel

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES", "Channel", "ChannelClosed", "ChannelStats", "Frame", "FrameError", "HandshakeError",
    "Hello", "Layout", "Row", "RowFlags", "StepKind", "WireDType", "decode_frame", "encode_frame",
    "encode_frame_into", "encode_parts", "frame_nbytes", "open_channel",
]  # fmt: skip

"""Which transport a freshly opened data link continues on: the two ends of the ``link`` message
(:mod:`~stagewise.transport.rings.link`), and :func:`open_link` for benchmarks and tests."""

from __future__ import annotations

from stagewise.transport.channel import Channel
from stagewise.transport.rings import link
from stagewise.transport.rings.cuda_ipc import CudaIpcChannel
from stagewise.transport.rings.shm import ShmChannel

LINK_TRANSPORTS = ("tcp", "shm", "cuda-ipc")
"""What a data link may continue on (the ``torch`` transport is a process group, not a link)."""


def upgrade_dialled(channel: Channel, transport: str, *, slot_bytes: int = 1 << 20, num_slots: int = 4,
                    device: int | None = None, checksum: bool = True, verify_checksum: bool = True) -> Channel:  # fmt: skip
    """On the dialling end of a TCP channel (after its hello): name the data transport in a
    ``link`` message. ``shm`` returns a :class:`ShmChannel` (frames sent by this end go through a
    ring of ``num_slots`` slots of ``slot_bytes``), ``cuda-ipc`` a :class:`CudaIpcChannel` (GPU
    tensors through a ring in ``device``'s memory), ``tcp`` the channel itself. ``checksum`` /
    ``verify_checksum``: whether this end's ring frames carry / check one."""
    if transport not in LINK_TRANSPORTS:
        raise ValueError(f"stagewise.transport: a link continues on one of {LINK_TRANSPORTS}, got {transport!r}")
    checks = dict(checksum=checksum, verify_checksum=verify_checksum)
    if transport == "shm":
        return ShmChannel.offer(channel, slot_bytes=slot_bytes, num_slots=num_slots, **checks)
    if transport == "cuda-ipc":
        return CudaIpcChannel.offer(channel, slot_bytes=slot_bytes, num_slots=num_slots, device=device, **checks)
    link.offer(channel, "tcp", "the tcp link")
    return channel


def upgrade_accepted(channel: Channel, *, device: int | None = None, checksum: bool = True,
                     verify_checksum: bool = True) -> Channel:  # fmt: skip
    """On the accepting end: read the dialler's ``link`` message and continue on its transport
    (a cuda-ipc ring is mapped on ``device``)."""
    message = link.read(channel, LINK_TRANSPORTS)
    checks = dict(checksum=checksum, verify_checksum=verify_checksum)
    if message["transport"] == "shm":
        return ShmChannel.attach(channel, message, **checks)
    if message["transport"] == "cuda-ipc":
        return CudaIpcChannel.attach(channel, message, device=device, **checks)
    link.ready(channel)
    return channel


def open_link(transport: str, *, hello, host: str | None = None, port: int | None = None, listener=None,
              auth_token=None, timeout: float = 30.0, slot_bytes: int = 1 << 20, num_slots: int = 4,
              device: int | None = None, checksum: bool = True, verify_checksum: bool = True,
              max_payload_bytes: int | None = None, tls=None) -> Channel:  # fmt: skip
    """One end of a data link on ``transport`` (one of :data:`LINK_TRANSPORTS`) over TCP, hello
    included: connect to ``host:port`` (then this end sends through the ring) or accept on
    ``listener`` (from ``tcp.listen``; this end receives). The TCP channel is closed if the link
    cannot be set up."""
    from stagewise.transport import tcp

    if transport not in LINK_TRANSPORTS:
        raise ValueError(f"stagewise.transport: open_link: transport must be one of {LINK_TRANSPORTS}, got {transport!r}")
    checks = dict(checksum=checksum, verify_checksum=verify_checksum)
    if listener is not None:
        channel = listener.accept(timeout)
    elif host is None or port is None:
        raise ValueError(f"stagewise.transport: open_link({transport!r}) needs host and port to connect, or listener= "
                         "to accept")  # fmt: skip
    else:
        limits = {} if max_payload_bytes is None else {"max_payload_bytes": max_payload_bytes}
        channel = tcp.connect(host, port, hello=hello, auth_token=auth_token, timeout=timeout, tls=tls, **checks,
                              **limits)
    try:
        if listener is not None:
            return upgrade_accepted(channel, device=device, **checks)
        return upgrade_dialled(channel, transport, slot_bytes=slot_bytes, num_slots=num_slots, device=device, **checks)
    except BaseException:
        channel.close()
        raise

"""Which transport a freshly opened data link continues on: the two ends of the ``link`` message
(:mod:`~stagewise.transport.rings.link`), each handing the channel to its transport's setup in
:mod:`stagewise.transport.registry`, and :func:`open_link` for benchmarks and tests."""

from __future__ import annotations

from stagewise.transport import registry
from stagewise.transport.channel import Channel
from stagewise.transport.rings import link


def upgrade_dialled(channel: Channel, transport: str, *, slot_bytes: int = 1 << 20, num_slots: int = 4,
                    device: int | None = None, checksum: bool = True, verify_checksum: bool = True) -> Channel:  # fmt: skip
    """On the dialling end of a TCP channel (after its hello): name the data transport (one of
    :data:`~stagewise.transport.registry.LINK_TRANSPORTS`) in a ``link`` message and continue on
    it: ``shm`` returns a :class:`ShmChannel` (frames sent by this end go through a ring of
    ``num_slots`` slots of ``slot_bytes``), ``cuda-ipc`` a :class:`CudaIpcChannel` (GPU tensors
    through a ring in ``device``'s memory), ``tcp`` the channel itself. ``checksum`` /
    ``verify_checksum``: whether this end's ring frames carry / check one."""
    if transport not in registry.LINK_TRANSPORTS:
        raise ValueError(f"stagewise.transport: a link continues on one of {registry.LINK_TRANSPORTS}, got "
                         f"{transport!r}")  # fmt: skip
    return registry.get(transport).load().offer(channel, slot_bytes=slot_bytes, num_slots=num_slots, device=device,
                                                checksum=checksum, verify_checksum=verify_checksum)


def upgrade_accepted(channel: Channel, *, device: int | None = None, checksum: bool = True,
                     verify_checksum: bool = True) -> Channel:  # fmt: skip
    """On the accepting end: read the dialler's ``link`` message and continue on its transport
    (a cuda-ipc ring is mapped on ``device``)."""
    message = link.read(channel, registry.LINK_TRANSPORTS)
    return registry.get(message["transport"]).load().attach(channel, message, device=device, checksum=checksum,
                                                            verify_checksum=verify_checksum)


def open_link(transport: str, *, hello, host: str | None = None, port: int | None = None, listener=None,
              auth_token=None, timeout: float = 30.0, slot_bytes: int = 1 << 20, num_slots: int = 4,
              device: int | None = None, checksum: bool = True, verify_checksum: bool = True,
              max_payload_bytes: int | None = None, tls=None) -> Channel:  # fmt: skip
    """One end of a data link on ``transport`` (a link transport of the registry) over TCP, hello
    included: connect to ``host:port`` (then this end sends through the ring) or accept on
    ``listener`` (from ``tcp.listen``; this end receives). The TCP channel is closed if the link
    cannot be set up."""
    from stagewise.transport import tcp

    if transport not in registry.LINK_TRANSPORTS:
        raise ValueError(f"stagewise.transport: open_link: transport must be one of {registry.LINK_TRANSPORTS}, "
                         f"got {transport!r}")
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

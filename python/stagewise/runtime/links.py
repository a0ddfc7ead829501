"""The connections of a pipeline, over :mod:`stagewise.transport`: one listener per stage,
and links named by role — ``driver`` (control), ``activations`` (stage i -> i + 1) and
``feedback`` (sampled tokens, last stage -> stage 0). Every link opens with the transport's
hello (protocol version, stage indices, role, model/plan fingerprint, optional auth token) over
TCP; a data link (activations, feedback) then names its transport in a first ``link`` message:
``tcp`` keeps the TCP channel, ``shm`` moves the frames to a shared-memory ring (stages on one
host; see :mod:`stagewise.transport.rings`)."""

from __future__ import annotations

from stagewise.transport import tcp
from stagewise.transport.hello import Hello
from stagewise.transport.rings import LINK_TRANSPORTS as DATA_TRANSPORTS
from stagewise.transport.rings import upgrade_accepted, upgrade_dialled

ROLES = ("driver", "activations", "feedback")


def listen(address: tuple[str, int], *, fingerprint: str, auth_token: str | None = None,
           checksum: bool = True) -> tcp.Listener:
    """A stage's listener: accepts any role whose hello carries the same fingerprint and token."""
    host, port = address
    return tcp.listen(host, port, hello=Hello(fingerprint=fingerprint, stage_from=None, stage_to=None, role=None),
                      auth_token=auth_token, checksum=checksum, verify_checksum=checksum)


def accept(listener: tcp.Listener, timeout: float, *, checksum: bool = True, device: int | None = None):
    """The next link and its role (TimeoutError when none arrives). Data links come back on the
    transport their dialler chose."""
    channel = listener.accept(timeout=timeout)
    role = channel.peer.role if channel.peer is not None else None
    if role not in ROLES:
        channel.close()
        raise ValueError(f"a peer connected with role {role!r}; expected one of {ROLES}")
    if role == "driver":
        return channel, role
    try:
        return upgrade_accepted(channel, device=device, checksum=checksum, verify_checksum=checksum), role
    except BaseException:
        channel.close()
        raise


def dial(address: tuple[str, int], *, transport: str, stage: int, peer: int, role: str, fingerprint: str,
         auth_token: str | None = None, checksum: bool = True, timeout: float = 60.0, slot_bytes: int = 1 << 20,
         num_slots: int = 4, device: int | None = None):
    """Connect to stage ``peer`` as stage ``stage`` (-1: the driver) for ``role``. A data link on
    ``shm`` gets a ring of ``num_slots`` slots of ``slot_bytes`` (bigger frames go over TCP)."""
    if role not in ROLES:
        raise ValueError(f"links.dial: role must be one of {ROLES}, got {role!r}")
    if role == "driver" and transport != "tcp":
        raise ValueError(f"links.dial: the driver's control link is TCP, got transport {transport!r}")
    if role != "driver" and transport not in DATA_TRANSPORTS:
        raise ValueError(f"links.dial: transport must be one of {DATA_TRANSPORTS} for a {role} link, got "
                         f"{transport!r}")
    host, port = address
    hello = Hello(fingerprint=fingerprint, stage_from=None if stage < 0 else stage, stage_to=peer, role=role)
    channel = tcp.connect(host, int(port), hello=hello, auth_token=auth_token, timeout=timeout, checksum=checksum,
                          verify_checksum=checksum)
    if role == "driver":
        return channel
    try:
        return upgrade_dialled(channel, transport, slot_bytes=slot_bytes, num_slots=num_slots, device=device,
                               checksum=checksum, verify_checksum=checksum)
    except BaseException:
        channel.close()
        raise

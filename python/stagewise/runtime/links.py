"""The connections of a pipeline, over :mod:`stagewise.transport`: one listener per stage,
and links named by role — ``driver`` (control), ``activations`` (stage i -> i + 1) and
``feedback`` (sampled tokens, last stage -> stage 0). Every link opens with the transport's
hello (protocol version, stage indices, role, model/plan fingerprint, optional auth token)."""

from __future__ import annotations

from stagewise.transport import tcp
from stagewise.transport.hello import Hello

ROLES = ("driver", "activations", "feedback")


def listen(address: tuple[str, int], *, fingerprint: str, auth_token: str | None = None,
           checksum: bool = True) -> tcp.Listener:
    """A stage's listener: accepts any role whose hello carries the same fingerprint and token."""
    host, port = address
    return tcp.listen(host, port, hello=Hello(fingerprint=fingerprint, stage_from=None, stage_to=None, role=None),
                      auth_token=auth_token, checksum=checksum, verify_checksum=checksum)


def accept(listener: tcp.Listener, timeout: float):
    """The next link and its role (TimeoutError when none arrives)."""
    channel = listener.accept(timeout=timeout)
    role = channel.peer.role if channel.peer is not None else None
    if role not in ROLES:
        channel.close()
        raise ValueError(f"a peer connected with role {role!r}; expected one of {ROLES}")
    return channel, role


def dial(address: tuple[str, int], *, transport: str, stage: int, peer: int, role: str, fingerprint: str,
         auth_token: str | None = None, checksum: bool = True, timeout: float = 60.0):
    """Connect to stage ``peer`` as stage ``stage`` (-1: the driver) for ``role``."""
    if role not in ROLES:
        raise ValueError(f"links.dial: role must be one of {ROLES}, got {role!r}")
    if transport not in ("tcp", "auto"):
        raise ValueError(f"links.dial: transport {transport!r} is not available for this link; use tcp")
    host, port = address
    hello = Hello(fingerprint=fingerprint, stage_from=None if stage < 0 else stage, stage_to=peer, role=role)
    return tcp.connect(host, int(port), hello=hello, auth_token=auth_token, timeout=timeout, checksum=checksum,
                       verify_checksum=checksum)

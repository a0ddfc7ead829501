"""``open_channel(kind, ...)``: one entry point for every transport, chosen per hop.

The rings (``shm`` for stages on one host, ``cuda-ipc`` between GPU processes on one host) live
in their own modules; each transport module offers ``open_channel(**options)``. ``auto`` picks
the fastest one that is present for the hop: cuda-ipc or shm within a host, tcp across hosts.
"""

from __future__ import annotations

import importlib
import ipaddress
import socket

from stagewise.transport.channel import Channel
from stagewise.transport.hello import Hello

TRANSPORTS = {
    "tcp": "stagewise.transport.tcp",
    "shm": "stagewise.transport.shm_channel",
    "cuda-ipc": "stagewise.transport.cuda_ipc_channel",
    "torch": "stagewise.transport.torch_dist",
}
KINDS = (*TRANSPORTS, "auto")


def available(kind: str) -> bool:
    """Whether this build has the transport (its module imports and offers ``open_channel``)."""
    try:
        return hasattr(importlib.import_module(TRANSPORTS[kind]), "open_channel")
    except ImportError:
        return False


def is_local_host(host: str) -> bool:
    """True when ``host`` is this machine (loopback, or one of its own addresses)."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    try:
        mine = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
        theirs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(mine & theirs) or any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in theirs)


def resolve(kind: str, *, same_host: bool, cuda: bool = False) -> str:
    """The concrete transport for ``kind`` ("auto" resolved); raises ValueError for unknown kinds."""
    if kind not in KINDS:
        raise ValueError(f"stagewise.transport: transport must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind != "auto":
        return kind
    for candidate in (("cuda-ipc",) if cuda else ()) + ("shm",):
        if same_host and available(candidate):
            return candidate
    return "tcp"


def open_channel(kind: str, *, hello: Hello, host: str | None = None, port: int | None = None, listener=None,
                 peer_rank: int | None = None, same_host: bool | None = None, cuda: bool = False,
                 auth_token=None, timeout: float = 30.0, **options) -> Channel:  # fmt: skip
    """Open one hop. tcp: ``host``/``port`` connects, ``listener`` (from ``tcp.listen``) accepts;
    torch: ``peer_rank``; shm / cuda-ipc: options of those modules. ``same_host`` (default: from
    ``host``) and ``cuda`` guide ``auto``. Options (checksum=, verify_checksum=,
    max_payload_bytes=, ...) go to the transport."""
    if same_host is None:
        same_host = host is None or is_local_host(host)
    chosen = resolve(kind, same_host=same_host, cuda=cuda)
    if chosen == "tcp":
        from stagewise.transport import tcp

        if listener is not None:
            return listener.accept(timeout)
        if host is None or port is None:
            raise ValueError("stagewise.transport: open_channel('tcp') needs host and port to connect, or listener= to accept")
        return tcp.connect(host, port, hello=hello, auth_token=auth_token, timeout=timeout, **options)
    if chosen == "torch":
        from stagewise.transport import torch_dist

        if peer_rank is None:
            raise ValueError("stagewise.transport: open_channel('torch') needs peer_rank")
        return torch_dist.open_channel(peer_rank, hello=hello, auth_token=auth_token, timeout=timeout, **options)
    if not available(chosen):
        raise NotImplementedError(
            f"stagewise.transport: transport {chosen!r} is not available in this build "
            f"({TRANSPORTS[chosen]} is missing); use tcp, torch or auto"
        )
    module = importlib.import_module(TRANSPORTS[chosen])
    return module.open_channel(hello=hello, host=host, port=port, listener=listener, auth_token=auth_token,
                               timeout=timeout, **options)  # fmt: skip

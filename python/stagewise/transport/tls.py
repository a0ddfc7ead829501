"""Mutual TLS for the TCP links between hosts (Python's ``ssl``).

A run's ``tls: {cert, key, ca}`` (plan key, or ``--tls-cert/--tls-key/--tls-ca``) names a PEM
certificate and key for this process and the CA that must have signed every peer's. With it, a
TCP connection to or from another host opens with a TLS handshake in which **both** sides present
a certificate and verify the other's against the CA (TLS 1.2 at least); only then does the hello
(fingerprint, token) run inside the encrypted stream. A peer with a certificate from another CA,
or none, or one that speaks plain text, fails the handshake: the connection is closed before a
single byte of it reaches the frame decoder, and the listener logs why and goes on.

Connections on loopback stay plain (nothing crosses a network; both ends see the same address, so
they agree), as do shared-memory hops, which never touch TCP. The certificate's host name is not
checked (stages are often addressed by IP): the CA is the trust, as in a private cluster's PKI.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from stagewise.transport.errors import HandshakeError

FIELDS = ("cert", "key", "ca")


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert: str
    """This process's certificate (PEM; the chain to the CA may follow it)."""
    key: str
    """Its private key (PEM)."""
    ca: str
    """The CA certificate(s) every peer's certificate must chain to (PEM)."""
    loopback: bool = False
    """Use TLS on loopback connections too (tests and benchmarks of TLS on one machine)."""

    @classmethod
    def from_dict(cls, data: Any, where: str = "tls") -> TlsConfig | None:
        """A config from a plan's ``tls`` mapping (None: no TLS); ValueError naming what is wrong."""
        if data is None:
            return None
        if not isinstance(data, dict) or set(data) - {*FIELDS, "loopback"} or not set(FIELDS) <= set(data):
            raise ValueError(f"{where} must be a mapping of cert, key and ca (PEM file paths), got {data!r}")
        bad = [f for f in FIELDS if not isinstance(data[f], str) or not data[f]]
        if bad or not isinstance(data.get("loopback", False), bool):
            raise ValueError(f"{where}: cert, key and ca must be file paths and loopback true or false, got {data!r}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f: getattr(self, f) for f in FIELDS}
        if self.loopback:
            d["loopback"] = True
        return d

    def applies(self, host: str) -> bool:
        """Whether a connection with ``host`` runs TLS."""
        return self.loopback or not is_loopback(host)

    def server_side(self, sock: socket.socket, peer: str) -> ssl.SSLSocket:
        """``sock`` (accepted, blocking with a timeout) after the handshake; HandshakeError if it fails."""
        return _handshake(self.cert, self.key, self.ca, sock, peer, server=True)

    def client_side(self, sock: socket.socket, peer: str) -> ssl.SSLSocket:
        return _handshake(self.cert, self.key, self.ca, sock, peer, server=False)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv4-mapped IPv6 included) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return False
    return bool(ip.is_loopback or (getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback))


@lru_cache(maxsize=8)
def _context(cert: str, key: str, ca: str, server: bool) -> ssl.SSLContext:
    for what, path in (("cert", cert), ("key", key), ("ca", ca)):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tls.{what}: no file at {path!r} on this host")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(cafile=ca)
    except (ssl.SSLError, ValueError) as err:
        raise ValueError(f"tls: cannot use cert {cert!r}, key {key!r}, ca {ca!r}: {err}") from None
    return ctx


def _handshake(cert: str, key: str, ca: str, sock: socket.socket, peer: str, *, server: bool) -> ssl.SSLSocket:
    """``sock`` wrapped after a completed handshake; on any failure ``sock`` is closed."""
    try:
        ctx = _context(cert, key, ca, server)
        return ctx.wrap_socket(sock, server_side=server)
    except (ssl.SSLError, ConnectionError, TimeoutError) as err:
        sock.close()
        why = getattr(err, "reason", None) or str(err)
        raise HandshakeError(f"stagewise.transport: TLS with {peer} failed ({why}): a certificate (its or ours) "
                             "not signed by the run's CA or out of date, none, or a peer that does not speak "
                             "TLS") from None
    except BaseException:
        sock.close()
        raise

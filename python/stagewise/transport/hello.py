"""The hello exchange that opens every connection, and its optional HMAC challenge-response.

Four frames, initiator I (the side that connected) and responder R (the side that accepted):

1. I -> R  HELLO   {"hello": I's fields, "nonce": 32 random bytes (hex), "auth": I has a token}
2. R -> I  HELLO   {"hello": R's fields, "nonce": ..., "auth": ..., "proof": HMAC or null}
           or CONTROL {"refused": why} when I's fields differ from R's or the auth settings differ
3. I -> R  CONTROL {"accept": true, "proof": HMAC or null}, or {"refused": why}
4. R -> I  CONTROL {"accept": true}, or {"refused": why} when I's proof is wrong

proof_R = HMAC-SHA256(token, "stagewise-auth-v1 responder\\n" + transcript) and proof_I the same
with "initiator", where transcript = canonical JSON of frame 1's body + "\\n" + canonical JSON of
frame 2's body without "proof": each side proves it knows the token, bound to both nonces and
both hellos, and neither proof can be replayed as the other (the labels differ). Compared with
``hmac.compare_digest``. The token authenticates the two ends when the connection opens; it does
not encrypt or sign the frames that follow (run across untrusted networks inside a VPN or tunnel).

Whichever side finds a mismatch sends the reason and raises :class:`HandshakeError`; the other
side raises it with the same reason, which names both sides' values.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import asdict, dataclass

from stagewise.transport.errors import ChannelClosed, FrameError, HandshakeError, HelloTimeout
from stagewise.transport.frame import VERSION, Frame, StepKind

PROTOCOL_VERSION = VERSION
HELLO_MAX_BYTES = 1 << 16
"""Largest frame accepted before the peer is authenticated."""
_FIELDS = ("protocol", "fingerprint", "stage_from", "stage_to", "role")


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """What one end of a connection states about the link. On a listener, ``stage_from``,
    ``stage_to`` and ``role`` may be None: any value is accepted (e.g. stage 0 accepts both the
    token link from the last stage and the driver's control link on one port)."""

    fingerprint: str
    """Identifies the model and the plan (e.g. a hash of checkpoint, dtype, layer ranges)."""
    stage_from: int | None
    """The stage that sends activations on this link (the connecting side, in a chain)."""
    stage_to: int | None
    role: str | None = "activations"
    """What the link carries: "activations", "tokens", "control", ..."""
    protocol: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, str):
            raise TypeError(f"stagewise.transport: Hello.fingerprint must be a str, got {type(self.fingerprint).__name__}")
        for name in ("stage_from", "stage_to"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v < 1 << 16):
                raise ValueError(f"stagewise.transport: Hello.{name} must be None or in [0, 65535], got {v!r}")

    @classmethod
    def from_json(cls, d) -> Hello:
        try:
            return cls(**{k: d[k] for k in _FIELDS})
        except (TypeError, KeyError, ValueError) as e:
            raise HandshakeError(f"stagewise.transport: malformed hello from the peer ({e}): {str(d)[:200]}") from None


def mismatches(a: Hello, b: Hello, a_name: str, b_name: str) -> list[str]:
    """One line per field where both sides state a value and the values differ."""
    out = []
    for f in _FIELDS:
        va, vb = getattr(a, f), getattr(b, f)
        if va is not None and vb is not None and va != vb:
            out.append(f"{f} differs: {a_name} has {va!r}, {b_name} has {vb!r}")
    return out


def auth_key(token) -> bytes | None:
    if token is None:
        return None
    key = token.encode() if isinstance(token, str) else bytes(token)
    if not key:
        raise ValueError("stagewise.transport: auth_token must not be empty (pass None for no authentication)")
    return key


def _canon(body: dict) -> bytes:
    return json.dumps({k: v for k, v in body.items() if k != "proof"}, sort_keys=True, separators=(",", ":")).encode()


def proof(key: bytes, label: str, transcript: bytes) -> str:
    """HMAC-SHA256 of ``transcript`` under ``key``, for the side ``label`` (its own domain)."""
    return hmac.new(key, f"stagewise-auth-v1 {label}\n".encode() + transcript, hashlib.sha256).hexdigest()


class _Exchange:
    """Frames of one handshake over any channel, with one deadline."""

    def __init__(self, channel, timeout: float | None, peer_name: str) -> None:
        self.channel, self.peer_name = channel, peer_name
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def send(self, kind: StepKind, body: dict) -> None:
        self.channel.send(Frame(step_kind=kind, control=body))

    def refuse(self, why: str) -> HandshakeError:
        try:
            self.send(StepKind.CONTROL, {"refused": why})
        except (OSError, ChannelClosed):
            pass  # the peer may already be gone; the reason is raised here anyway
        return HandshakeError(f"stagewise.transport: hello refused: {why}")

    def recv(self, expect: StepKind) -> dict:
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            frame = self.channel.recv(timeout=left, max_frame_bytes=HELLO_MAX_BYTES)
        except TimeoutError:
            raise HelloTimeout(f"stagewise.transport: no hello from {self.peer_name} in time") from None
        except ChannelClosed as e:
            raise HandshakeError(f"stagewise.transport: {self.peer_name} closed the connection during the hello ({e})") from None
        except FrameError as e:
            raise HandshakeError(f"stagewise.transport: {self.peer_name} does not speak this protocol: {e}") from None
        body = frame.control or {}
        if "refused" in body:
            raise HandshakeError(f"stagewise.transport: hello refused by {self.peer_name}: {body['refused']}")
        if frame.step_kind != expect:
            raise HandshakeError(f"stagewise.transport: expected a {expect.name} frame from {self.peer_name} during the hello, got {frame.step_kind.name}")
        return body


def handshake(channel, hello: Hello, *, initiator: bool, auth_token=None, timeout: float | None = 10.0,
              local_name: str = "this side", peer_name: str = "the peer") -> Hello:  # fmt: skip
    """Run the hello exchange on a fresh channel; returns the peer's Hello or raises HandshakeError.
    ``local_name`` / ``peer_name`` describe the two ends in messages ("listener at 127.0.0.1:5000")."""
    key = auth_key(auth_token)
    ex = _Exchange(channel, timeout, peer_name)
    mine = {"hello": asdict(hello), "nonce": secrets.token_hex(32), "auth": key is not None}
    if initiator:
        ex.send(StepKind.HELLO, mine)
        theirs = ex.recv(StepKind.HELLO)
        peer = Hello.from_json(theirs.get("hello"))
        why = _compare(hello, peer, key, theirs, local_name, peer_name)
        transcript = _canon(mine) + b"\n" + _canon(theirs)
        if not why and key is not None:
            if not hmac.compare_digest(str(theirs.get("proof")), proof(key, "responder", transcript)):
                why = [f"auth token differs: {peer_name}'s proof does not match {local_name}'s token"]
        if why:
            raise ex.refuse("; ".join(why))
        ex.send(StepKind.CONTROL, {"accept": True, "proof": key and proof(key, "initiator", transcript)})
        ex.recv(StepKind.CONTROL)
        return peer
    theirs = ex.recv(StepKind.HELLO)
    peer = Hello.from_json(theirs.get("hello"))
    why = _compare(hello, peer, key, theirs, local_name, peer_name)
    if why:
        raise ex.refuse("; ".join(why))
    transcript = _canon(theirs) + b"\n" + _canon(mine)
    mine["proof"] = key and proof(key, "responder", transcript)
    ex.send(StepKind.HELLO, mine)
    answer = ex.recv(StepKind.CONTROL)
    if key is not None and not hmac.compare_digest(str(answer.get("proof")), proof(key, "initiator", transcript)):
        raise ex.refuse(f"auth token differs: {peer_name}'s proof does not match {local_name}'s token")
    ex.send(StepKind.CONTROL, {"accept": True})
    return peer


def _compare(mine: Hello, peer: Hello, key, theirs: dict, local_name: str, peer_name: str) -> list[str]:
    why = mismatches(mine, peer, local_name, peer_name)
    if (key is not None) != bool(theirs.get("auth")):
        why.append(f"auth token: {local_name} {'requires one' if key is not None else 'has none'}, "
                   f"{peer_name} {'has one' if theirs.get('auth') else 'has none'}")  # fmt: skip
    return why

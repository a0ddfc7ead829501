"""What every row family of `stagewise bench transport` times with, whatever carries the frames:
the frames, the echo peer, the duplex of two one-way ring links, and :func:`measure` (ping-pong
and bursts).

- latency: ping-pong, the peer sends each frame back; one-way = median round trip / 2;
- stream GB/s: :data:`WINDOW` frames back to back, the peer acknowledges the last with an empty
  frame; bytes of the frames over the median time of that burst.

Where the frames are CUDA tensors, the host's send and receive only enqueue the copies and the
waits; ``settle`` (called after each receive, inside the timed interval) then waits until this
process's GPU has done them, so that a round trip ends when the echoed bytes are there.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from stagewise.transport import Frame, Hello, StepKind, tcp

HIDDEN = 1024
WINDOW = 4
HELLO = Hello(fingerprint="bench/transport", stage_from=0, stage_to=1)


class Duplex:
    """Two one-way ring links as one channel: frames out through one ring, in through the other
    (as between pipeline stages, where each direction has its own ring)."""

    def __init__(self, out, inn) -> None:
        self.out, self.inn = out, inn

    def send(self, frame) -> None:
        self.out.send(frame)

    def recv(self, timeout=None):
        return self.inn.recv(timeout)

    @property
    def checksum(self) -> bool:
        return self.out.checksum

    @checksum.setter
    def checksum(self, value: bool) -> None:
        self.out.checksum = self.inn.checksum = value

    @property
    def verify_checksum(self) -> bool:
        return self.inn.verify_checksum

    @verify_checksum.setter
    def verify_checksum(self, value: bool) -> None:
        self.out.verify_checksum = self.inn.verify_checksum = value

    def close(self) -> None:
        # The ring this end reads first: a cuda-ipc ring's creator (the other end's ``out``) waits
        # in its close until the reader has detached, so both ends closing ``out`` first would
        # each wait for the other.
        try:
            self.inn.close()
        finally:
            self.out.close()


def dial_pair(kind: str, port: int, *, slot_bytes: int, device: int | None = None, check: bool = True,
              timeout: float = 60) -> Duplex:  # fmt: skip
    """The peer's side of a ring duplex on ``kind`` (``shm``, ``cuda-ipc``): dial the bench's
    listener at ``port`` for the ring towards it, then accept the bench's ring towards this side."""
    from stagewise.transport.rings import open_link

    opts = dict(checksum=check, verify_checksum=check, device=device, timeout=timeout)
    out = open_link(kind, hello=HELLO, host="127.0.0.1", port=port, slot_bytes=slot_bytes, num_slots=WINDOW + 1,
                    **opts)  # fmt: skip
    try:
        with tcp.listen(hello=HELLO, checksum=check, verify_checksum=check) as lis:
            out.send(Frame(step_kind=StepKind.CONTROL, control={"port": lis.address[1]}))
            inn = open_link(kind, hello=HELLO, listener=lis, **opts)
    except BaseException:
        out.close()
        raise
    return Duplex(out, inn)


def accept_pair(kind: str, lis, *, slot_bytes: int, device: int | None = None, check: bool = True,
                timeout: float = 120) -> Duplex:  # fmt: skip
    """The bench's side of :func:`dial_pair`: accept the peer's ring on ``lis``, then dial the
    listener it names for the ring towards the peer."""
    from stagewise.transport.rings import open_link

    opts = dict(checksum=check, verify_checksum=check, device=device)
    inn = open_link(kind, hello=HELLO, listener=lis, timeout=timeout, **opts)
    try:
        port = inn.recv(timeout).control["port"]
        out = open_link(kind, hello=HELLO, host="127.0.0.1", port=port, slot_bytes=slot_bytes,
                        num_slots=WINDOW + 1, timeout=timeout, **opts)  # fmt: skip
    except BaseException:
        inn.close()
        raise
    return Duplex(out, inn)


def echo(ch) -> None:
    """The peer's loop until the bench's ``stop``: each frame back, ``ack`` frames acknowledged
    (the last of a burst) or not; ``{"set_checksum": bool}`` takes effect from the next frame on,
    on both sides. Closes ``ch``."""
    try:
        while True:
            f = ch.recv()
            ctl = f.control or {}
            if ctl.get("stop"):
                break
            if "set_checksum" in ctl:
                ch.checksum = ch.verify_checksum = ctl["set_checksum"]
                ch.send(Frame(step_kind=StepKind.HEARTBEAT))
                continue
            if "ack" not in ctl:
                ch.send(f)
            elif ctl["ack"]:
                ch.send(Frame(step_kind=StepKind.HEARTBEAT))
    finally:
        ch.close()


def frame(nbytes: int, ack: bool | None = None, device: str | torch.device = "cpu") -> Frame:
    """A frame of one bfloat16 "hidden" tensor of ``nbytes``, like a decode or prefill step's."""
    hidden = torch.randn(1, nbytes // (2 * HIDDEN), HIDDEN, device=device).to(torch.bfloat16)
    return Frame(step_kind=StepKind.PREFILL, tensors={"hidden": hidden}, control=None if ack is None else {"ack": ack})


def repeats(est_s: float, quick: bool) -> int:
    return max(3, min(30 if quick else 200, int((0.2 if quick else 0.5) / max(est_s, 1e-6))))


def size_text(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def _nothing() -> None:
    pass


def measure(ch, nbytes: int, quick: bool, *, device: str | torch.device = "cpu",
            settle: Callable[[], None] = _nothing) -> dict:  # fmt: skip
    """One row: ping-pong and bursts of ``nbytes`` frames on ``device`` over ``ch`` to an
    :func:`echo` peer, after one echo checked against what was sent."""
    f = frame(nbytes, device=device)

    def round_trip() -> Frame:
        ch.send(f)
        got = ch.recv()
        settle()
        return got

    round_trip()
    if not torch.equal(round_trip().tensors["hidden"], f.tensors["hidden"]):
        raise RuntimeError(f"stagewise bench transport: a {nbytes}-byte frame came back changed")
    t0 = time.perf_counter()
    round_trip()
    rtts = []
    for _ in range(repeats(time.perf_counter() - t0, quick)):
        t0 = time.perf_counter()
        round_trip()
        rtts.append(time.perf_counter() - t0)
    burst = [frame(nbytes, ack=False, device=device)] * (WINDOW - 1) + [frame(nbytes, ack=True, device=device)]
    times = []
    for _ in range(max(3, min(10, repeats(WINDOW * statistics.median(rtts) / 2, quick) // 4))):
        t0 = time.perf_counter()
        for b in burst:
            ch.send(b)
        ch.recv()
        settle()
        times.append(time.perf_counter() - t0)
    one_way = statistics.median(rtts) / 2
    return {"bytes": nbytes, "one_way_us": one_way * 1e6, "pingpong_gbps": nbytes / one_way / 1e9,
            "stream_gbps": WINDOW * nbytes / statistics.median(times) / 1e9, "repeats": len(rtts)}  # fmt: skip

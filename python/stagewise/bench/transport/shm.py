"""``stagewise bench shm``: the shared-memory ring against socket baselines, between two processes on
this host. Per message size (8 KB ... 64 MB; ``--tiny``: 8 KB and 64 KB, one round):

* one-way latency: ping-pong (send n bytes, the peer sends n bytes back), round trip / 2;
* bandwidth: the sender streams messages back to back (a ring holds ``num_slots`` of
  them in flight, a socket its buffers); the receiver consumes them and answers the last
  with one byte; bytes / (first send to that answer).

Transports, measured side by side in one run:

* ``shm``: :class:`~stagewise.transport.rings.ShmRing`; the sender copies the message into
  the slot, the receiver uses the slot in place (zero copy: what a pipeline stage does);
* ``shm+copy``: the same, but the receiver also copies each message out (the work a socket
  receiver does; the strict comparison);
* ``shm/ops``: the ring through the torch ops (the dispatcher) instead of the extension's
  direct functions (latency only, small messages): the price of the dispatcher;
* ``tcp``: loopback TCP, TCP_NODELAY, ``sendall`` / ``recv_into`` a preallocated buffer;
* ``unix``: a Unix-domain stream socketpair, likewise.

Sockets carry raw payloads (both sides know the size): no framing cost, which favours them.
Every timing is the median of ``repeats`` rounds after one warm-up round; each transport's
peer is a separate ``python -m stagewise.bench.transport.shm PLAN`` process (PLAN is JSON); all
run at once and the transports take turns round by round.
The first echo of each size is checked byte for byte before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

DEFAULT_SIZES = [8 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20]
TRANSPORTS = ("shm", "shm+copy", "shm/ops", "tcp", "unix")
_OPS_MAX_BYTES = 64 << 10  # shm/ops: latency of small messages only


@dataclass(kw_only=True, slots=True)
class TransportRow:
    transport: str
    nbytes: int
    """Message size."""
    one_way_us: float | None = None
    """Median over rounds of (ping-pong round trip / 2), microseconds."""
    one_way_us_min: float | None = None
    gbps: float | None = None
    """Median over rounds of streamed bytes / time, 1e9 bytes per second."""
    pingpong_iters: int = 0
    stream_messages: int = 0
    repeats: int = 0


def _pingpong_iters(n: int) -> int:
    return max(10, min(2000, (32 << 20) // n))


def _stream_messages(n: int) -> int:
    return max(8, min(4000, (256 << 20) // n))


# ---- the two ends of a transport -------------------------------------------------


class _RingEnd:
    def __init__(self, tx, rx):
        self.tx, self.rx = tx, rx

    def send(self, src: memoryview) -> None:
        self.tx.reserve(len(src))[:] = src
        self.tx.commit()

    def recv(self, dst: memoryview | None) -> None:
        view = self.rx.acquire()
        if dst is not None:
            dst[: len(view)] = view
        self.rx.release()

    def echo(self, buf: memoryview) -> None:
        view = self.rx.acquire()
        self.tx.reserve(len(view))[:] = view
        self.tx.commit()
        self.rx.release()

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


class _SocketEnd:
    def __init__(self, sock: socket.socket):
        self.sock = sock

    def send(self, src: memoryview) -> None:
        self.sock.sendall(src)

    def recv(self, dst: memoryview) -> None:
        got, n = 0, len(dst)
        while got < n:
            k = self.sock.recv_into(dst[got:], n - got)
            if k == 0:
                raise EOFError("stagewise bench shm: the peer closed the socket")
            got += k

    def echo(self, buf: memoryview) -> None:
        self.recv(buf)
        self.sock.sendall(buf)

    def close(self) -> None:
        self.sock.close()


# ---- the rounds (the same plan on both sides) ------------------------------------


def _plan_rounds(plan: dict):
    """(size, pingpong iters, stream messages, timed) for each round, in order."""
    for n in plan["sizes"]:
        stream = plan["transport"] != "shm/ops"
        for r in range(plan["repeats"] + 1):  # round 0: warm-up (page faults, caches)
            yield n, _pingpong_iters(n), _stream_messages(n) if stream else 0, r > 0


def _peer(plan: dict) -> None:
    end = _open_peer_end(plan)
    buf = memoryview(bytearray(max(plan["sizes"])))
    ack = memoryview(b"k")
    zero_copy = plan["transport"] in ("shm", "shm/ops")
    for n, iters, messages, _ in _plan_rounds(plan):
        for _ in range(iters):
            end.echo(buf[:n])
        for _ in range(messages):
            end.recv(None if zero_copy else buf[:n])
        if messages:
            end.send(ack)
    if plan.get("idle_s"):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        end.recv(buf[:8])
        end.send(memoryview(struct.pack("<dd", time.process_time() - cpu0, time.perf_counter() - wall0)))
    end.close()


def _open_peer_end(plan: dict):
    if plan["transport"].startswith("shm"):
        from stagewise.transport.rings import ShmRing

        rx, tx = (ShmRing.attach(name, timeout=60) for name in plan["rings"])  # the driver's tx, rx
        if plan["transport"] == "shm/ops":
            rx.use_torch_ops()
            tx.use_torch_ops()
        return _RingEnd(tx=tx, rx=rx)
    if plan["transport"] == "tcp":
        sock = socket.create_connection(("127.0.0.1", plan["port"]))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _SocketEnd(sock)
    return _SocketEnd(socket.socket(fileno=plan["fd"]))


class _Link:
    """The driver's side of one transport: its peer process, its end, its timings."""

    def __init__(self, transport: str, sizes: list[int], repeats: int, spin_us: int, num_slots: int, idle_s: float):
        self.transport = transport
        self.plan = {"transport": transport, "sizes": sizes, "repeats": repeats, "idle_s": idle_s}
        self.times: dict[int, tuple[list, list]] = {n: ([], []) for n in sizes}
        pass_fds, listener, theirs = (), None, None
        if transport.startswith("shm"):
            from stagewise.transport.rings import ShmRing

            self.plan["rings"] = [ShmRing.unique_name("bench-shm") for _ in range(2)]
            rings = [ShmRing.create(nm, max(sizes), num_slots, spin_us=spin_us) for nm in self.plan["rings"]]
            if transport == "shm/ops":
                for ring in rings:
                    ring.use_torch_ops()
            self.end = _RingEnd(tx=rings[0], rx=rings[1])
        elif transport == "tcp":
            listener = socket.create_server(("127.0.0.1", 0))
            self.plan["port"] = listener.getsockname()[1]
        else:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self.plan["fd"], pass_fds = theirs.fileno(), (theirs.fileno(),)
            self.end = _SocketEnd(mine)
        cmd = [sys.executable, "-m", "stagewise.bench.transport.shm", json.dumps(self.plan)]
        self.proc = subprocess.Popen(cmd, pass_fds=pass_fds)
        if theirs is not None:
            theirs.close()
        if listener is not None:
            listener.settimeout(120)
            with listener:
                sock, _ = listener.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.end = _SocketEnd(sock)

    def rounds(self):
        """Run the plan's rounds, yielding after each, so that transports can take turns."""
        plan = self.plan
        src = memoryview(bytearray((i * 131 + 7) & 0xFF for i in range(256)) * (max(plan["sizes"]) // 256 + 1))
        dst, ack = memoryview(bytearray(len(src))), memoryview(bytearray(1))
        end = self.end
        for n, iters, messages, timed in _plan_rounds(plan):
            if not timed:  # check the echo once, before timing
                end.send(src[:n])
                end.recv(dst[:n])
                if dst[:n] != src[:n]:
                    raise RuntimeError(f"stagewise bench shm: {self.transport} echo of {n} bytes differs")
                iters -= 1
            t0 = time.perf_counter()
            for _ in range(iters):
                end.send(src[:n])
                end.recv(dst[:n])
            t1 = time.perf_counter()
            for _ in range(messages):
                end.send(src[:n])
            if messages:
                end.recv(ack)
            t2 = time.perf_counter()
            if timed:
                self.times[n][0].append((t1 - t0) / iters / 2 * 1e6)
                if messages:
                    self.times[n][1].append(messages * n / (t2 - t1) / 1e9)
            yield

    def idle(self) -> dict:
        """The peer's CPU use while it waited idle_s on an empty channel."""
        time.sleep(self.plan["idle_s"])
        self.end.send(memoryview(bytes(8)))
        reply = memoryview(bytearray(16))
        self.end.recv(reply)
        cpu, wall = struct.unpack("<dd", reply)
        return {"transport": self.transport, "waited_s": wall, "cpu_s": cpu, "cpu_fraction": cpu / wall}

    def rows(self) -> list[TransportRow]:
        return [
            TransportRow(
                transport=self.transport, nbytes=n, one_way_us=statistics.median(lat), one_way_us_min=min(lat),
                gbps=statistics.median(bw) if bw else None, pingpong_iters=_pingpong_iters(n),
                stream_messages=_stream_messages(n) if bw else 0, repeats=len(lat),
            )  # fmt: skip
            for n, (lat, bw) in self.times.items()
        ]

    def close(self, ok: bool) -> None:
        if hasattr(self, "end"):
            self.end.close()
        if ok and self.proc.wait(timeout=120) != 0:
            raise RuntimeError(
                f"stagewise bench shm: the {self.transport} peer exited with {self.proc.returncode}"
            )
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def measure_shm(
    sizes: list[int] = DEFAULT_SIZES,
    repeats: int = 5,
    *,
    transports: tuple[str, ...] = TRANSPORTS,
    spin_us: int = 50,
    num_slots: int = 4,
    idle_s: float = 1.0,
    idle: list | None = None,
) -> list[TransportRow]:
    """Measure each transport between this process and a peer process; one row per (transport, size).

    All peers run at once and the transports take turns round by round, so that a change in the
    machine's load during the run touches them alike. With ``idle`` a list, the shm and tcp peers'
    CPU use while blocked ``idle_s`` seconds on an empty channel is appended to it
    (``cpu_fraction`` = CPU seconds / wall seconds).
    """
    for t in transports:
        if t not in TRANSPORTS:
            raise ValueError(f"stagewise bench shm: transport must be one of {TRANSPORTS}, got {t!r}")
    links, ok = [], False
    try:
        for t in transports:
            ts = [n for n in sizes if n <= _OPS_MAX_BYTES] if t == "shm/ops" else list(sizes)
            if ts:
                want_idle = idle is not None and t in ("shm", "tcp")
                links.append(_Link(t, ts, repeats, spin_us, num_slots, idle_s if want_idle else 0.0))
        turns = [link.rounds() for link in links]
        while turns:
            turns = [turn for turn in turns if next(turn, StopIteration) is not StopIteration]
        for link in links:
            if link.plan["idle_s"]:
                idle.append(link.idle())
        ok = True
    finally:
        for link in links:
            link.close(ok)
    return [row for link in links for row in link.rows()]


def summary(rows: list[TransportRow]) -> dict:
    """The targets of the transport issue: shm >= 3x tcp GB/s at >= 1 MB, shm one-way <= 20 us at 8 KB."""
    by = {(r.transport, r.nbytes): r for r in rows}
    ratios = {}
    for (t, n), r in sorted(by.items(), key=lambda kv: kv[0][1]):
        tcp = by.get(("tcp", n))
        if t.startswith("shm") and r.gbps and tcp and tcp.gbps and n >= 1 << 20:
            ratios.setdefault(t, {})[n] = r.gbps / tcp.gbps
    small = by.get(("shm", 8 << 10))
    return {
        "gbps_ratio_over_tcp": ratios,
        "bandwidth_target_met": {t: all(v >= 3 for v in rs.values()) for t, rs in ratios.items()},
        "shm_one_way_us_8k": small.one_way_us if small else None,
        "latency_target_met": (small.one_way_us <= 20) if small else None,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stagewise.bench.options import add_common

    add_common(parser, "shm")
    parser.add_argument("--sizes", type=_sizes, default=None,
                        help="comma-separated message bytes (default: 8 KB to 64 MB; --tiny: 8192,65536)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per size (default 5; --tiny: 1)")
    parser.add_argument("--transports", type=lambda s: tuple(s.split(",")), default=TRANSPORTS,
                        help=f"comma-separated subset of {','.join(TRANSPORTS)} (default: all)")
    parser.add_argument("--spin-us", type=int, default=50, help="how long a ring end spins before it sleeps")
    parser.add_argument("--num-slots", type=int, default=4, help="slots of each ring")


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def run(args: argparse.Namespace, log) -> int:
    from stagewise.bench.transport import shm_report

    sizes = args.sizes or ([8 << 10, 64 << 10] if args.tiny else DEFAULT_SIZES)
    repeats = args.repeats or (1 if args.tiny else 5)
    try:
        idle: list = []
        load_before = os.getloadavg()[0]
        rows = measure_shm(sizes, repeats, transports=args.transports, spin_us=args.spin_us,
                           num_slots=args.num_slots, idle=idle)  # fmt: skip
    except ValueError as err:
        log(str(err))
        return 2
    config = {"repeats": repeats, "spin_us": args.spin_us, "num_slots": args.num_slots,
              "load_average_1m": [load_before, os.getloadavg()[0]]}  # fmt: skip
    print(shm_report.format_table(rows, idle, summary(rows)))
    json_path, md_path = shm_report.write(args.out, config, [asdict(r) for r in rows], idle, summary(rows))
    log(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":  # a peer process, started by _Link with its plan
    _peer(json.loads(sys.argv[1]))

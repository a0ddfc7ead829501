"""The run of `stagewise bench transport`: one-way latency and GB/s of each transport, 8 KB ... 64 MB
frames.

Every transport is a row family of :data:`MEASURED`: a function that starts an echo peer in a
spawned process and returns this side's channel. ``shm`` is a pair of one-way shared-memory
rings (one per direction, as between pipeline stages), set up over TCP; ``tcp-tls`` is TCP inside
mutual TLS, as between hosts with the plan's ``tls`` (on loopback here, with throwaway
certificates: the cost of the encryption itself); the cuda-ipc ring is not here yet (it needs a
GPU).
Frames carry one bfloat16 "hidden" tensor of the given size, like a decode or prefill step.

- latency: ping-pong, the peer sends each frame back; one-way = median round trip / 2 (includes
  encode, checksum, send, receive, decode on both sides);
- stream GB/s: 4 frames back to back, the peer acknowledges the last with an empty frame; bytes of
  the 4 frames over the median time of that burst.

Both with the checksum on (computed by the sender, verified by the receiver) and off. The copy
bandwidth of this machine and the checksum's own rate (the extension's CRC32C, which the links
use, beside the ``crc32c`` package, the Python codec's reference) are measured in the same run.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch

from stagewise.bench import report
from stagewise.transport import Frame, Hello, StepKind, checksum
from stagewise.transport import tcp, torch_dist

SIZES = [8 << 10, 64 << 10, 512 << 10, 4 << 20, 32 << 20, 64 << 20]
QUICK_SIZES = [8 << 10, 1 << 20, 16 << 20]
HIDDEN = 1024
WINDOW = 4
HELLO = Hello(fingerprint="bench/transport", stage_from=0, stage_to=1)


class _Duplex:
    """Two one-way shm links as one channel: frames out through one ring, in through the other
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
        self.out.close()
        self.inn.close()


SHM_SLOT_BYTES = (64 << 20) + (1 << 20)


def _shm_pair(port: int | None, check: bool):
    """Peer side (``port`` given): dial the bench's listener for the ring towards it, then accept
    the bench's ring towards this side. Bench side: the reverse."""
    from stagewise.transport.rings import open_link

    opts = dict(checksum=check, verify_checksum=check)
    if port is not None:
        out = open_link("shm", hello=HELLO, host="127.0.0.1", port=port, slot_bytes=SHM_SLOT_BYTES,
                        num_slots=WINDOW + 1, timeout=60, **opts)
        lis = tcp.listen(hello=HELLO, **opts)
        out.send(Frame(step_kind=StepKind.CONTROL, control={"port": lis.address[1]}))
        inn = open_link("shm", hello=HELLO, listener=lis, timeout=60, **opts)
        lis.close()
        return _Duplex(out, inn)
    raise ValueError("_shm_pair: the bench side is _start_shm")


def _peer(kind: str, port: int, check: bool, tls=None) -> None:
    """The echo side, in its own process."""
    torch.set_num_threads(1)
    if kind == "tcp":
        ch = tcp.connect("127.0.0.1", port, hello=HELLO, timeout=60, checksum=check, verify_checksum=check, tls=tls)
    elif kind == "shm":
        ch = _shm_pair(port, check)
    else:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
        ch = torch_dist.open_channel(0, hello=HELLO, timeout=60, checksum=check, verify_checksum=check)
    while True:
        f = ch.recv()
        ctl = f.control or {}
        if ctl.get("stop"):
            break
        if "set_checksum" in ctl:  # takes effect from the next frame on, on both sides
            ch.checksum = ch.verify_checksum = ctl["set_checksum"]
            ch.send(Frame(step_kind=StepKind.HEARTBEAT))
            continue
        if "ack" not in ctl:
            ch.send(f)
        elif ctl["ack"]:
            ch.send(Frame(step_kind=StepKind.HEARTBEAT))
    ch.close()


def _start_tcp(check: bool, tls=None):
    import multiprocessing as mp

    lis = tcp.listen(hello=HELLO, checksum=check, verify_checksum=check, tls=tls)
    proc = mp.get_context("spawn").Process(target=_peer, args=("tcp", lis.address[1], check, tls), daemon=True)
    proc.start()
    ch = lis.accept(120)
    lis.close()
    return ch, proc


def _start_tcp_tls(check: bool):
    """TCP in mutual TLS: certificates made for the run, read by both ends during the handshake and
    deleted after it."""
    import tempfile

    try:
        from stagewise.bench.transport.certs import make_pki
    except ImportError:
        raise RuntimeError("transport tcp-tls makes its certificates with the cryptography package: "
                           "pip install cryptography") from None
    from stagewise.transport.tls import TlsConfig

    with tempfile.TemporaryDirectory(prefix="stagewise-tls-") as folder:
        from pathlib import Path

        pki = make_pki(Path(folder))
        cert, key = pki["stage"]
        return _start_tcp(check, TlsConfig(cert=cert, key=key, ca=pki["ca"], loopback=True))


def _start_torch(check: bool):
    import multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = mp.get_context("spawn").Process(target=_peer, args=("torch", port, check), daemon=True)
    proc.start()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    return torch_dist.open_channel(1, hello=HELLO, timeout=120, checksum=check, verify_checksum=check), proc


def _start_shm(check: bool):
    import multiprocessing as mp

    from stagewise.transport.rings import open_link

    opts = dict(checksum=check, verify_checksum=check)
    lis = tcp.listen(hello=HELLO, **opts)
    proc = mp.get_context("spawn").Process(target=_peer, args=("shm", lis.address[1], check), daemon=True)
    proc.start()
    inn = open_link("shm", hello=HELLO, listener=lis, timeout=120, **opts)
    lis.close()
    port = inn.recv(60).control["port"]
    out = open_link("shm", hello=HELLO, host="127.0.0.1", port=port, slot_bytes=SHM_SLOT_BYTES,
                    num_slots=WINDOW + 1, timeout=60, **opts)
    return _Duplex(out, inn), proc


MEASURED: dict[str, Callable] = {"tcp": _start_tcp, "tcp-tls": _start_tcp_tls, "shm": _start_shm,
                                 "torch": _start_torch}
"""name -> start(checksum) -> (channel to an echo peer, peer process). The peer follows
{"set_checksum": bool} control frames, so one peer serves both settings."""


def _frame(nbytes: int, ack: bool | None = None) -> Frame:
    hidden = torch.randn(1, nbytes // (2 * HIDDEN), HIDDEN).to(torch.bfloat16)
    return Frame(step_kind=StepKind.PREFILL, tensors={"hidden": hidden}, control=None if ack is None else {"ack": ack})


def _repeats(est_s: float, quick: bool) -> int:
    return max(3, min(30 if quick else 200, int((0.2 if quick else 0.5) / max(est_s, 1e-6))))


def measure(ch, nbytes: int, quick: bool) -> dict:
    f = _frame(nbytes)
    for _ in range(2):
        ch.send(f)
        ch.recv()
    t0 = time.perf_counter()
    ch.send(f)
    ch.recv()
    rtts = []
    for _ in range(_repeats(time.perf_counter() - t0, quick)):
        t0 = time.perf_counter()
        ch.send(f)
        ch.recv()
        rtts.append(time.perf_counter() - t0)
    burst = [_frame(nbytes, ack=False)] * (WINDOW - 1) + [_frame(nbytes, ack=True)]
    times = []
    for _ in range(max(3, min(10, _repeats(WINDOW * statistics.median(rtts) / 2, quick) // 4))):
        t0 = time.perf_counter()
        for b in burst:
            ch.send(b)
        ch.recv()
        times.append(time.perf_counter() - t0)
    one_way = statistics.median(rtts) / 2
    return {"bytes": nbytes, "one_way_us": one_way * 1e6, "pingpong_gbps": nbytes / one_way / 1e9,
            "stream_gbps": WINDOW * nbytes / statistics.median(times) / 1e9, "repeats": len(rtts)}  # fmt: skip


def checksum_gbps(nbytes: int = 64 << 20, digest=checksum.digest) -> float:
    """One core's checksum rate over ``nbytes`` from memory (median of 5; 64 MB does not fit a cache)."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
    digest([data])
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        digest([data])
        t.append(time.perf_counter() - t0)
    return nbytes / statistics.median(t) / 1e9


def codec_us(nbytes: int = 8 << 10, repeats: int = 2000) -> dict:
    """In-process cost of the codec for one frame of this bench (median of 7 loops): encode into a
    buffer (what the shm sender does into a slot) and decode as views (what the shm receiver does),
    checksum on and off."""
    from stagewise.transport import codec

    f = _frame(nbytes)
    out = {}
    for check in (True, False):
        prepared = codec.prepare_frame(f, checksum=check)
        slot = memoryview(bytearray(prepared.nbytes))
        data = memoryview(bytes(slot[: prepared.write(slot)]))

        def encode() -> None:
            codec.prepare_frame(f, checksum=check).write(slot)

        def decode() -> None:
            codec.decode_frame(data, verify_checksum=check, copy=False)

        for name, fn in (("encode", encode), ("decode", decode)):
            loops = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(repeats // 7):
                    fn()
                loops.append((time.perf_counter() - t0) / (repeats // 7))
            out[f"{name}_{'on' if check else 'off'}"] = statistics.median(loops) * 1e6
    return out


def run(args, log: Callable[[str], None]) -> int:
    names = [n.strip() for n in (args.transports or ",".join(MEASURED)).split(",") if n.strip()]
    unknown = [n for n in names if n not in MEASURED]
    if unknown or not names:
        log(f"stagewise bench: --transports must name some of {', '.join(MEASURED)}, got {args.transports!r}")
        return 2
    sizes = [8 << 10, 64 << 10] if args.tiny else QUICK_SIZES if args.quick else SIZES
    info = report.machine_info("cpu")
    load_start = os.getloadavg()
    from stagewise.measure.timing import TimingPolicy, copy_bandwidth

    copy_bw = copy_bandwidth("cpu", 1 << 28, TimingPolicy(warmup=2, min_repeats=5, max_repeats=20))
    hash_gbps = checksum_gbps()
    hash_cached_gbps = checksum_gbps(1 << 20)
    reference_gbps = checksum_gbps(digest=checksum.reference_digest)
    codec_cost = codec_us()
    log(f"{info['device_name']}: copy bandwidth {copy_bw['gbps']:.1f} GB/s, {checksum.NAME} {hash_gbps:.2f} GB/s, "
        f"8 KB frame encode {codec_cost['encode_on']:.1f} µs / decode {codec_cost['decode_on']:.1f} µs")
    rows = []
    for name in names:
        ch, proc = MEASURED[name](True)
        try:
            for check in (True, False):
                ch.send(Frame(step_kind=StepKind.CONTROL, control={"set_checksum": check}))
                ch.recv()
                ch.checksum = ch.verify_checksum = check
                for nbytes in sizes:
                    log(f"{name} checksum={'on' if check else 'off'} {nbytes} bytes")
                    rows.append({"transport": name, "checksum": check, **measure(ch, nbytes, args.quick or args.tiny)})
            ch.send(Frame(step_kind=StepKind.CONTROL, control={"stop": True}))
            proc.join(30)
        finally:
            ch.close()
            if proc.is_alive():
                proc.kill()
    for r in rows:
        r["pct_copy"] = 100 * r["stream_gbps"] / copy_bw["gbps"]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{info['device']}-transport"
    info.update(checksum=checksum.NAME, checksum_isa=checksum.hardware() or "software", checksum_gbps=hash_gbps,
                checksum_cached_gbps=hash_cached_gbps, checksum_reference_gbps=reference_gbps,
                load_average={"start": list(load_start), "end": list(os.getloadavg())})  # fmt: skip
    stem.with_suffix(".json").write_text(json.dumps({"machine": info, "copy_bandwidth": copy_bw, "codec_us": codec_cost,
                                                     "rows": rows}, indent=2) + "\n")  # fmt: skip
    md = _markdown(info, copy_bw, rows, codec_cost)
    stem.with_suffix(".md").write_text(md)
    print(md)
    log(f"wrote {stem}.json and {stem}.md")
    return 0


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def _markdown(info: dict, copy_bw: dict, rows: list[dict], codec_cost: dict | None = None) -> str:
    lines = [
        "# stagewise transports", "",
        f"Machine: {info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, "
        f"{info['torch_threads']} torch threads; torch {info['torch']}  ",
        f"Date (UTC): {info['date_utc']}; commit: {info['git_commit'] or 'unknown'}  ",
        f"Copy bandwidth (read + write): {copy_bw['gbps']:.1f} GB/s; checksum {info['checksum']} "
        f"({info.get('checksum_isa', '?')}), one core: {info['checksum_gbps']:.2f} GB/s from memory (64 MB), "
        f"{info.get('checksum_cached_gbps', float('nan')):.2f} GB/s in cache (1 MB); the crc32c package "
        f"{info.get('checksum_reference_gbps', float('nan')):.2f} GB/s  ",
        (f"Codec, one 8 KB frame in-process: encode into a slot {codec_cost['encode_on']:.1f} µs "
         f"({codec_cost['encode_off']:.1f} without checksum), decode as views {codec_cost['decode_on']:.1f} µs "
         f"({codec_cost['decode_off']:.1f})  " if codec_cost else ""),
        f"Load average (1, 5, 15 min) at the start: {', '.join(f'{x:.2f}' for x in info['load_average']['start'])}; "
        f"at the end: {', '.join(f'{x:.2f}' for x in info['load_average']['end'])} (a shared 2-core machine: other "
        f"processes compete for the cores)" if "load_average" in info else "", "",
        "Frames of one bfloat16 hidden tensor, sender and echo peer in two processes on this machine. "
        "One-way = median ping-pong round trip / 2, encode + checksum + send + receive + decode included; "
        "pingpong GB/s = bytes / one-way; stream GB/s = 4 frames back to back, acknowledged, median. "
        "% copy = stream GB/s over the copy bandwidth.", "",
        "| transport | checksum | size | one-way µs | pingpong GB/s | stream GB/s | % copy |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['transport']} | {'on' if r['checksum'] else 'off'} | {_size(r['bytes'])} | "
                     f"{r['one_way_us']:.1f} | {r['pingpong_gbps']:.2f} | {r['stream_gbps']:.2f} | {r['pct_copy']:.0f}% |")  # fmt: skip
    return "\n".join(lines) + "\n"

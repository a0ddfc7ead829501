"""The run of `stagewise bench transport`: one-way latency and GB/s of each transport, 8 KB ... 64 MB
frames.

Every transport between two processes of the host is a row family of :data:`MEASURED`: a function
that starts an echo peer in a spawned process and returns this side's channel. ``shm`` is a pair of
one-way shared-memory rings (one per direction, as between pipeline stages), set up over TCP;
``tcp-tls`` is TCP inside mutual TLS, as between hosts with the plan's ``tls`` (on loopback here,
with throwaway certificates: the cost of the encryption itself). ``cuda-ipc`` (frames of CUDA
tensors between two processes on one GPU, beside the device-to-device copy) has its own section,
:mod:`~stagewise.bench.transport.cuda_ipc`; where it cannot run (no GPU, an extension without CUDA)
it is recorded as skipped, with the reason. :data:`TRANSPORTS` names them all.
Frames carry one bfloat16 "hidden" tensor of the given size, like a decode or prefill step; the
timing is :func:`~stagewise.bench.transport.pingpong.measure`'s:

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
from stagewise.bench.transport import cuda_ipc
from stagewise.bench.transport.pingpong import HELLO, accept_pair, dial_pair, echo, frame, measure, size_text
from stagewise.transport import Frame, StepKind, checksum
from stagewise.transport import tcp, torch_dist

SIZES = [8 << 10, 64 << 10, 512 << 10, 4 << 20, 32 << 20, 64 << 20]
QUICK_SIZES = [8 << 10, 1 << 20, 16 << 20]
SHM_SLOT_BYTES = (64 << 20) + (1 << 20)


def _peer(kind: str, port: int, check: bool, tls=None) -> None:
    """The echo side, in its own process."""
    torch.set_num_threads(1)
    if kind == "tcp":
        ch = tcp.connect("127.0.0.1", port, hello=HELLO, timeout=60, checksum=check, verify_checksum=check, tls=tls)
    elif kind == "shm":
        ch = dial_pair("shm", port, slot_bytes=SHM_SLOT_BYTES, check=check)
    else:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
        ch = torch_dist.open_channel(0, hello=HELLO, timeout=60, checksum=check, verify_checksum=check)
    echo(ch)


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

    with tcp.listen(hello=HELLO, checksum=check, verify_checksum=check) as lis:
        proc = mp.get_context("spawn").Process(target=_peer, args=("shm", lis.address[1], check), daemon=True)
        proc.start()
        try:
            return accept_pair("shm", lis, slot_bytes=SHM_SLOT_BYTES, check=check), proc
        except BaseException:
            proc.kill()
            raise


MEASURED: dict[str, Callable] = {"tcp": _start_tcp, "tcp-tls": _start_tcp_tls, "shm": _start_shm,
                                 "torch": _start_torch}
"""name -> start(checksum) -> (channel to an echo peer, peer process). The peer follows
{"set_checksum": bool} control frames, so one peer serves both settings."""
TRANSPORTS = (*MEASURED, cuda_ipc.NAME)
"""What ``--transports`` may name, and its default."""


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

    f = frame(nbytes)
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
    names = [n.strip() for n in (args.transports or ",".join(TRANSPORTS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in TRANSPORTS]
    if unknown or not names:
        log(f"stagewise bench: --transports must name some of {', '.join(TRANSPORTS)}, got {args.transports!r}")
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
    rows, skipped, gpu = [], [], None
    for name in names:
        if name == cuda_ipc.NAME:
            why = cuda_ipc.unavailable()
            if why is None:
                gpu = cuda_ipc.run(sizes, args.quick or args.tiny, log)
            else:
                log(f"{name}: skipped: {why}")
                skipped.append({"transport": name, "why": why})
            continue
        rows += _measure_host(name, sizes, args.quick or args.tiny, log)
    for r in rows:
        r["pct_copy"] = 100 * r["stream_gbps"] / copy_bw["gbps"]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{info['device']}-transport"
    info.update(checksum=checksum.NAME, checksum_isa=checksum.hardware() or "software", checksum_gbps=hash_gbps,
                checksum_cached_gbps=hash_cached_gbps, checksum_reference_gbps=reference_gbps,
                load_average={"start": list(load_start), "end": list(os.getloadavg())})  # fmt: skip
    stem.with_suffix(".json").write_text(json.dumps({"machine": info, "copy_bandwidth": copy_bw, "codec_us": codec_cost,
                                                     "rows": rows, cuda_ipc.NAME: gpu, "skipped": skipped},
                                                    indent=2) + "\n")  # fmt: skip
    md = _markdown(info, copy_bw, rows, codec_cost)
    if gpu is not None:
        md += "\n".join(cuda_ipc.markdown(gpu)) + "\n"
    if skipped:
        md += "\n" + "".join(f"Skipped {s['transport']}: {s['why']}  \n" for s in skipped)
    stem.with_suffix(".md").write_text(md)
    print(md)
    log(f"wrote {stem}.json and {stem}.md")
    return 1 if gpu is not None and gpu["error"] else 0


def _measure_host(name: str, sizes: list[int], quick: bool, log) -> list[dict]:
    """The rows of one transport of :data:`MEASURED`, checksum on and off."""
    rows = []
    ch, proc = MEASURED[name](True)
    try:
        for check in (True, False):
            ch.send(Frame(step_kind=StepKind.CONTROL, control={"set_checksum": check}))
            ch.recv()
            ch.checksum = ch.verify_checksum = check
            for nbytes in sizes:
                log(f"{name} checksum={'on' if check else 'off'} {nbytes} bytes")
                rows.append({"transport": name, "checksum": check, **measure(ch, nbytes, quick)})
        ch.send(Frame(step_kind=StepKind.CONTROL, control={"stop": True}))
        proc.join(30)
    finally:
        ch.close()
        if proc.is_alive():
            proc.kill()
    return rows


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
        f"at the end: {', '.join(f'{x:.2f}' for x in info['load_average']['end'])} (the machine's "
        f"{info.get('cpu_count', '?')} CPUs may be shared: other processes compete for them)" if "load_average" in info else "", "",
        "Frames of one bfloat16 hidden tensor, sender and echo peer in two processes on this machine. "
        "One-way = median ping-pong round trip / 2, encode + checksum + send + receive + decode included; "
        "pingpong GB/s = bytes / one-way; stream GB/s = 4 frames back to back, acknowledged, median. "
        "% copy = stream GB/s over the copy bandwidth.", "",
        "| transport | checksum | size | one-way µs | pingpong GB/s | stream GB/s | % copy |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['transport']} | {'on' if r['checksum'] else 'off'} | {size_text(r['bytes'])} | "
                     f"{r['one_way_us']:.1f} | {r['pingpong_gbps']:.2f} | {r['stream_gbps']:.2f} | {r['pct_copy']:.0f}% |")  # fmt: skip
    return "\n".join(lines) + "\n"

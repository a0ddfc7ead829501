"""The run of `stagewise bench profile`: measure this machine into a device profile the planner
reads (:mod:`stagewise.planner.profiles` describes the fields), from the primitives the runtime's
node profile measures too (:mod:`stagewise.measure`) and those only this suite measures.

- matmul FLOP/s per dtype: ``torch.mm`` of square matrices (median of repeats);
- memory bandwidth: ``dst.copy_(src)`` far beyond the caches (read + write bytes);
- op overhead: the median time of a tiny op (dispatch cost every operator pays);
- transports: latency (half a 64-byte round trip) and bandwidth (one 16 MiB message one way)
  per transport in :data:`TRANSPORTS`; each entry is one function, so a new transport (shared
  memory ring, torch.distributed) adds one row. On a CPU, ``tcp`` and ``shm`` are the pipeline's
  own links as a stage's step crosses them (:func:`stagewise.bench.profile.hop.measure_hop`:
  protocol, codec and waking included, caches cold), and the PP link is the one the pipeline
  picks by default on one host (shm);
- CPU only, the TP link (``links["tp"]``, also taken for ``ep``): all-reduces and all-gathers of
  float32 tensors (2 KiB - 1 MiB) in the TP group of a stage of two rank processes on this host,
  joined as the runtime joins it, fitted to the planner's ring formulas
  (:func:`stagewise.bench.profile.tp.measure_tp_link`); on a GPU the PP link stands in;
- CPU only, the runtime's own costs: ``quant`` (the block-quantised linear per GGUF type) and
  ``attention_decode`` (:mod:`stagewise.measure.primitives`), ``framework`` (Python/dispatch per
  decoder layer and per step of each stage role: :mod:`stagewise.bench.profile.framework`),
  ``cores`` and ``concurrency`` (1, 2, 3 busy processes side by side:
  :mod:`stagewise.bench.profile.runtime`).

The measured rates are achieved ones: the profile's efficiencies are 1.0.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from stagewise.measure.primitives import matmul_flops, op_overhead
from stagewise.measure.timing import TimingPolicy, copy_bandwidth

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _recv_exact(sock: socket.socket, n: int, buf: bytearray) -> None:
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:n])
        if k == 0:
            raise ConnectionError("bench profile: peer closed the connection")
        got += k


def measure_tcp(message_bytes: int = 16 * 2**20, pings: int = 200, repeats: int = 5) -> dict:
    """TCP loopback between two threads of this process: 64-byte ping-pong and one-way bulk."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    buf_small = bytearray(64)
    payload = bytes(message_bytes)

    def peer() -> None:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        b, big = bytearray(64), bytearray(message_bytes)
        with conn:
            for _ in range(pings + 10):
                _recv_exact(conn, 64, b)
                conn.sendall(b)
            for _ in range(repeats + 1):
                _recv_exact(conn, message_bytes, big)
                conn.sendall(b"k")

    th = threading.Thread(target=peer, daemon=True)
    th.start()
    cli = socket.create_connection(("127.0.0.1", port))
    cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = bytearray(1)
    try:
        rtts = []
        for i in range(pings + 10):
            t0 = time.perf_counter()
            cli.sendall(buf_small)
            _recv_exact(cli, 64, buf_small)
            if i >= 10:
                rtts.append(time.perf_counter() - t0)
        bulk = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            cli.sendall(payload)
            _recv_exact(cli, 1, ack)
            if i:
                bulk.append(time.perf_counter() - t0)
    finally:
        cli.close()
        th.join(timeout=10)
        server.close()
    latency = statistics.median(rtts) / 2
    t = statistics.median(bulk)
    return {"latency_s": latency, "bandwidth": message_bytes / max(t - latency, 1e-9),
            "message_bytes": message_bytes, "what": "TCP loopback, plain sockets, two threads"}


# One function per transport; each returns {"latency_s", "bandwidth", ...}.
TRANSPORTS: dict[str, Callable[[], dict]] = {"tcp": measure_tcp}


def measure_profile(device: str, *, quick: bool = False, log=print) -> dict:
    """A profile dict of this machine (see :mod:`stagewise.planner.profiles`)."""
    from stagewise.bench import report

    policy = TimingPolicy(warmup=2, min_repeats=3, max_repeats=20 if quick else 50, budget_s=0.2 if quick else 0.5)
    info = report.machine_info(device)
    is_cuda = torch.device(device).type == "cuda"
    peaks, raw = {}, {}
    for name, dtype in DTYPES.items():
        n = (4096 if not quick else 2048) if is_cuda else (256 if quick else 512) if dtype != torch.float32 else \
            (512 if quick else 1024)
        try:
            r = matmul_flops(dtype, device, n, policy)
        except RuntimeError as err:  # a dtype the device cannot multiply
            log(f"  matmul {name}: n/a ({err})")
            continue
        peaks[name], raw[f"matmul_{name}"] = r["flops"], r
        log(f"  matmul {name} n={n}: {r['flops'] / 1e9:.1f} GFLOP/s")
    copy_bytes = 2**30 if is_cuda else 2**26 if quick else 2**28
    bw = copy_bandwidth(device, copy_bytes, policy)
    raw["copy"] = bw
    log(f"  copy bandwidth: {bw['gbps']:.1f} GB/s")
    overhead = op_overhead(device, policy)
    raw["op_overhead_s"] = overhead
    log(f"  op overhead: {overhead * 1e6:.1f} us")
    transports = {}
    for name, fn in TRANSPORTS.items():
        try:
            transports[name] = fn()
            log(f"  transport {name}: latency {transports[name]['latency_s'] * 1e6:.1f} us, "
                f"bandwidth {transports[name]['bandwidth'] / 1e9:.2f} GB/s")
        except OSError as err:
            log(f"  transport {name}: n/a ({err})")
    extra = {}
    if not is_cuda:
        from stagewise.bench.profile import framework
        from stagewise.bench.profile import runtime as rt
        from stagewise.bench.profile.hop import measure_hop
        from stagewise.measure import primitives

        for name in ("tcp", "shm"):  # the pipeline's links replace the plain-socket figure
            try:
                transports[name] = measure_hop(name)
                log(f"  pipeline link {name}: latency {transports[name]['latency_s'] * 1e6:.1f} us, "
                    f"bandwidth {transports[name]['bandwidth'] / 1e9:.2f} GB/s")
            except OSError as err:
                log(f"  pipeline link {name}: n/a ({err})")
        try:  # the TP link: the collectives of a stage of two rank processes on this host
            from stagewise.bench.profile.tp import measure_tp_link

            tp_link = measure_tp_link(calls=20 if quick else 100, log=log)
            raw["tp_link"] = tp_link
        except (OSError, RuntimeError) as err:
            log(f"  TP link: n/a ({err}); the PP link stands in for it")
        extra["quant"] = primitives.quant_rates(log=log)
        attn = primitives.attention_decode_rate(log=log)
        raw["attention_decode"] = attn
        extra["attention_decode"] = {k: attn[k] for k in ("flops", "bandwidth", "call_s")}
        fw = framework.framework_overheads(log=log)
        raw["framework"] = fw.pop("raw")
        extra["framework"] = fw
        extra["concurrency"] = rt.concurrency(3, log=log)
        raw["background_load"] = rt.background_load()
        log(f"  background load: {raw['background_load']:.2f} runnable threads of other work (recorded, not modelled)")
        from stagewise.launch.local import usable_cores

        extra["cores"] = usable_cores()
        raw["quant"] = extra["quant"]
        extra["quant"] = {k: {"s_per_weight": v["s_per_weight"], "flops": v["flops"],
                              "rows_s_per_weight": v["rows_s_per_weight"], "rows_s_per_output": v["rows_s_per_output"]}
                          for k, v in extra["quant"].items()}
    link = transports.get("shm") or transports.get("tcp") or {"latency_s": 50e-6, "bandwidth": 1e9}
    link = {"latency_s": link["latency_s"], "bandwidth": link["bandwidth"]}
    tp = raw.get("tp_link") or link
    tp = {"latency_s": tp["latency_s"], "bandwidth": tp["bandwidth"],
          **({"collectives": {"ranks": 2, "all_reduce_s": tp["all_reduce_s"], "all_gather_s": tp["all_gather_s"]}}
             if "all_reduce_s" in tp else {})}
    if is_cuda:
        memory_bytes = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        import os

        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "name": f"measured-{info['device']}",
        "description": f"measured on {info['device_name']} with {info['torch_threads']} torch threads "
                       f"({info['date_utc']})",
        "kind": "gpu" if is_cuda else "cpu",
        "memory_bytes": int(memory_bytes),
        "peak_flops": peaks,
        "memory_bandwidth": bw["gbps"] * 1e9,
        "efficiency": {"matmul": 1.0, "attention": 1.0, "memory": 1.0},
        "op_overhead_s": overhead,
        "links": {"tp": tp, "pp": link, "ep": tp},
        "transports": {k: {"latency_s": v["latency_s"], "bandwidth": v["bandwidth"]} for k, v in transports.items()},
        "measured": {"machine": info, "raw": raw, "quick": quick},
        **extra,
    }


def run(args, log=print) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from stagewise.bench import report

    log(f"measuring {report.machine_info(device)['device_name']} ({torch.get_num_threads()} torch threads)")
    profile = measure_profile(device, quick=args.quick or args.tiny, log=log)
    from stagewise.planner.profiles import profile_from_dict

    profile_from_dict(profile, "measured")  # the planner must be able to read it
    args.out.mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"{profile['measured']['machine']['device']}-profile.json"
    path.write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps({k: profile[k] for k in ("name", "peak_flops", "memory_bandwidth", "op_overhead_s",
                                              "transports", "quant", "attention_decode", "framework", "cores",
                                              "concurrency") if k in profile},
                     indent=2))
    log(f"wrote {path} (use it with: stagewise plan ... --device-profile {path})")
    return 0

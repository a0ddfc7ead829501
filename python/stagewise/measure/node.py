"""A node's speed in seconds, for ``--partition measured``: the planner's profile primitives
(:mod:`~stagewise.measure.primitives`, :mod:`~stagewise.measure.framework`) at quick settings,
only what a stage's decode step needs (matmul rate, memory bandwidth, op overhead, the
block-quantised linear of the model's GGUF types, the decode attention kernel, the per-layer
framework cost), with this process's torch threads, and the memory free for weights. Cached per host, device, threads and types in the user's cache
folder (``$XDG_CACHE_HOME/stagewise/nodes``, else ``~/.cache/...``): a node is measured once, unless
asked to measure again (``reuse=False``, ``--remeasure``). The profile's ``measured`` section says
where it came from: ``at`` (when it was measured, seconds since the epoch), ``cache`` (its file) and
``from_cache`` (read from that file rather than measured now).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch

CACHE_VERSION = 2


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stagewise" / "nodes"


def free_memory(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def cache_path(device: str, threads: int, types: tuple[str, ...] = ()) -> Path:
    """The cache file of this host's profile for ``device``, ``threads`` and GGUF ``types``."""
    key = f"{socket.gethostname()}-{device.replace(':', '')}-t{threads}-{'+'.join(sorted(types)) or 'dense'}"
    return cache_dir() / f"{key}.json"


def node_profile(device: str = "cpu", types: tuple[str, ...] = (), *, cache: bool = True, reuse: bool = True,
                 log=None) -> dict:
    """This node's profile dict (see :mod:`stagewise.planner.profiles`), from the cache when it has
    one for this host, device, thread count and GGUF types and ``reuse`` allows it, else measured
    now (and cached, unless ``cache`` is False); ``memory_bytes`` is measured now either way."""
    threads = torch.get_num_threads()
    path = cache_path(device, threads, types)
    if cache and reuse and path.is_file():
        try:
            got = json.loads(path.read_text())
            measured = got.get("measured", {})
            if measured.get("cache_version") == CACHE_VERSION:
                # A profile cached before dates were kept: the file's own time.
                origin = {"at": measured.get("at") or path.stat().st_mtime, "cache": str(path), "from_cache": True}
                return {**got, "memory_bytes": free_memory(device), "measured": {**measured, **origin}}
        except (OSError, ValueError):
            pass
    out = _measure(device, types, threads, path.stem, log)
    saved = None
    if cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(out, indent=1))
            tmp.replace(path)
            saved = str(path)
        except OSError:
            pass  # a read-only home: measured again next time
    out["measured"].update(cache=saved, from_cache=False)
    return out


def _measure(device: str, types: tuple[str, ...], threads: int, key: str, log) -> dict:
    """The profile, measured now (seconds)."""
    from stagewise.measure.primitives import matmul_flops, op_overhead
    from stagewise.measure.timing import TimingPolicy, copy_bandwidth

    at = time.time()
    start = time.perf_counter()
    policy = TimingPolicy(warmup=1, min_repeats=3, max_repeats=10, budget_s=0.1)
    peak = matmul_flops(torch.float32, device, 512, policy)["flops"]
    bandwidth = copy_bandwidth(device, 1 << 26, policy)["gbps"] * 1e9
    out = {"name": f"node-{key}", "kind": "gpu" if device.startswith("cuda") else "cpu",
           "description": f"{socket.gethostname()} {device}, {threads} torch threads (--partition measured)",
           "memory_bytes": free_memory(device), "peak_flops": {"float32": peak}, "memory_bandwidth": bandwidth,
           "efficiency": {"matmul": 1.0, "attention": 1.0, "memory": 1.0}, "op_overhead_s": op_overhead(device, policy),
           # Links are the run's own (the hops are not this node's): placeholders the split does not read.
           "links": {k: {"latency_s": 20e-6, "bandwidth": 5e9} for k in ("tp", "pp", "ep")}}
    if out["kind"] == "cpu":
        from stagewise.measure import primitives as rt
        from stagewise.measure.framework import role_overheads, streamed_layer_s

        quiet = log or (lambda *a: None)
        if types:
            quant = rt.quant_rates(log=quiet, rounds=3, types=tuple(types))
            out["quant"] = {k: {f: v[f] for f in ("s_per_weight", "flops", "rows_s_per_weight", "rows_s_per_output")}
                            for k, v in quant.items()}
        attn = rt.attention_decode_rate(log=quiet, repeats=3, calls=50)
        out["attention_decode"] = {k: attn[k] for k in ("flops", "bandwidth", "call_s")}
        layer = streamed_layer_s(steps=10, rounds=3)
        # Each stage role's fixed step cost: it weighs the first and the last stage, and the
        # predicted TPOT holds it.
        roles = role_overheads(steps=10, repeats=2)
        roles.pop("raw")
        out["framework"] = {"layer_s": layer["framework_s"] / layer["layers"], **roles}
        out["cores"] = threads
    out["measured"] = {"cache_version": CACHE_VERSION, "seconds": time.perf_counter() - start, "threads": threads,
                       "host": socket.gethostname(), "device": device, "types": sorted(types), "at": at}
    return out

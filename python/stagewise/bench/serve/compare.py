"""`stagewise bench serve`: `stagewise serve` and llama.cpp's OpenAI server (llama-cpp-python's
``llama_cpp.server``, an optional dependency of the benchmark only) on the same GGUF and cores,
and with ``--server-baseline llama.cpp,vllm`` vLLM's CPU server too (:mod:`stagewise.bench.vllm_cpu`,
in an environment of its own), each under the same Poisson load at each ``--rates`` (see
:mod:`stagewise.bench.serve.load`), one after the other on this machine.

Threads: with ``--threads N`` both servers compute with N threads; without it llama.cpp runs with
as many threads as the machine has cores and ours makes its own choice (on the CPU every core for a
step of several tokens, one fewer for a lone stream's decode, which leaves its HTTP loop a core:
each server has the whole machine).

Both generate every requested token: ours is asked for ``ignore_eos``, llama.cpp gets a logit
bias of -100 on the EOS ids. Comparison at equal p99 TPOT: the TPOT budget is llama.cpp's p99 TPOT
at the rate where it served the most requests per second; each server's throughput is its best
requests per second among the rates whose p99 TPOT is within that budget.

Ours runs several times (a row group each): with its first ``--linear-precision`` as it starts by
default (prompts start as soon as they fit), then with each precision and a TPOT target
(``serve --tpot-target``, :mod:`stagewise.engine.pacing`). ``--tpot-target auto`` (the default)
runs llama.cpp first and gives ours :data:`HEADROOM` of its budget: our server keeps each
request's mean time per token on its own clock, the client's p99 adds the HTTP stream's jitter.
llama.cpp's arithmetic on a Q4/Q8 GGUF multiplies int8-quantised activations, as ours does with
``int8``; ``exact`` computes in float32 on the exact dequantised weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stagewise.bench import report
from stagewise.bench.serve.load import run_load
from stagewise.bench.serve.workloads import OUTPUT, PROMPT, TINY, Shape, Sizes, num_requests, workload
from stagewise.parallel.plan_options import tpot_target_problem

RATES = "0.5,1,2,4"
PROMPT_CACHE = ("multi-turn", "documents")
"""Workloads whose shared prefixes the previous prompt does not hold: llama.cpp gets its RAM prompt
cache there (on the system-prompt workload it served 0.51 req/s with it, 0.78 without)."""
HEADROOM = 0.8
"""Ours' TPOT target with ``--tpot-target auto``: this share of llama.cpp's measured budget."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free local port, stopped (its process group) by :meth:`stop`."""

    def __init__(self, name: str, argv: list[str], health: str, env: dict, timeout_s: float = 300.0) -> None:
        import httpx

        self.name, self.port = name, int(argv[argv.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        # Its log into a file (a pipe nobody reads would fill and stop the server), read on failure.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=self.log, text=True,
                                     start_new_session=True)
        start = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"bench serve: {name} exited: {self.log.read()[-2000:]}")
            try:
                if httpx.get(self.url + health, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > timeout_s:
                self.stop()
                raise TimeoutError(f"bench serve: {name} did not answer within {timeout_s:.0f} s")
            time.sleep(0.2)
        self.ready_s = time.perf_counter() - start

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _ours(model: str, threads: int | None, env: dict, precision: str, target_ms: float | None,
          stages: int = 1, prefix_cache: bool = True, kv_cache_dtype: str = "auto") -> Server:
    """``threads`` None: the server's own choice (on the CPU every core, one fewer for a step of one
    token); ``stages`` > 1: a pipeline of that many stage processes."""
    port = _free_port()
    argv = [sys.executable, "-m", "stagewise.cli", "serve", model, "--port", str(port), "--max-num-seqs", "32",
            "--max-waiting", "1024", "--log-level", "warning", "--linear-precision", precision]
    argv += ([] if threads is None else ["--threads", str(threads)])
    argv += ([] if stages == 1 else ["--stages", str(stages)])
    argv += ([] if target_ms is None else ["--tpot-target", f"{target_ms:g}"])
    argv += ([] if prefix_cache else ["--no-prefix-cache"])
    argv += ([] if kv_cache_dtype == "auto" else ["--kv-cache-dtype", kv_cache_dtype])
    return Server("stagewise", argv, "/health", {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"})


def _name(precision: str, target_ms: float | None, stages: int = 1, prefix_cache: bool = True,
          kv_cache_dtype: str = "auto") -> str:
    return (f"stagewise {precision}" + ("" if kv_cache_dtype == "auto" else f", {kv_cache_dtype} KV cache")
            + ("" if stages == 1 else f", {stages} stages")
            + ("" if target_ms is None else f", TPOT target {target_ms:g} ms")
            + ("" if prefix_cache else ", no prefix cache"))


def _llama_cpp(gguf: Path, threads: int, env: dict, install: bool, log, prompt_cache: bool = False) -> Server:
    """llama-cpp-python's server: one request at a time, each reusing the KV of the longest prefix
    it shares with the prompt before it; with ``prompt_cache`` (:data:`PROMPT_CACHE`) also its RAM
    cache of evaluated prompts' states (``--cache``, 2 GiB), which finds a prefix any earlier prompt
    left."""
    from stagewise.bench import llama_cpp

    lib = llama_cpp.find_or_install(install, log=log, suite="serve")
    try:
        import llama_cpp.server  # noqa: F401 - its extra: fastapi, sse-starlette, ...
    except ImportError as err:
        raise ImportError(f"bench serve: llama.cpp's server needs llama-cpp-python[server] ({err}): "
                          f'pip install "llama-cpp-python[server]"') from None
    port = _free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--n_ctx", "4096", "--host", "127.0.0.1", "--port", str(port),
            "--interrupt_requests", "False"]  # queue concurrent requests (its default ends the running one)
    argv += ["--cache", "True"] if prompt_cache else []
    server = Server("llama.cpp", argv, "/v1/models", env)
    server.version = getattr(lib, "__version__", "unknown")
    return server


def _budget_compare(rows: dict[str, list[dict]]) -> dict | None:
    """llama.cpp's budget (its p99 TPOT at its best rate) and, for each other server's run (ours,
    vLLM), its best requests per second within it."""
    base = [r for r in rows.get("llama.cpp", []) if r["tpot_p99_s"] is not None]
    if not base:
        return None
    best = max(base, key=lambda r: r["req_per_s"])
    budget = best["tpot_p99_s"]
    ours = {}
    for name, rs in rows.items():
        within = [r for r in rs if name != "llama.cpp" and r["tpot_p99_s"] is not None and r["tpot_p99_s"] <= budget]
        if name != "llama.cpp":
            top = max(within, key=lambda r: r["req_per_s"]) if within else None
            ours[name] = {"req_per_s": top["req_per_s"] if top else 0.0, "rate": top["rate"] if top else None,
                          "ratio": top["req_per_s"] / best["req_per_s"] if top and best["req_per_s"] else 0.0}
    return {"tpot_p99_budget_s": budget, "llama_cpp_req_per_s": best["req_per_s"], "llama_cpp_rate": best["rate"],
            "servers": ours}


def _target(args, rows: dict[str, list[dict]]) -> float | None:
    """Ours' TPOT target in ms from ``--tpot-target`` (auto: HEADROOM of llama.cpp's budget)."""
    if args.tpot_target == "none":
        return None
    if args.tpot_target != "auto":
        return float(args.tpot_target)
    compare = _budget_compare(rows)
    return None if compare is None else round(HEADROOM * compare["tpot_p99_budget_s"] * 1e3, 1)


def run(args, log=print) -> int:
    from stagewise.model.loader import open_checkpoint

    try:
        rates = [float(x) for x in (args.rates or RATES).split(",") if x.strip()]
        if not rates or any(r <= 0 for r in rates):
            raise ValueError
    except ValueError:
        log(f"stagewise bench: --rates takes positive requests per second such as {RATES}, got {args.rates!r}")
        return 2
    precisions = [p.strip() for p in args.linear_precision.split(",") if p.strip()]
    if not precisions or any(p not in ("exact", "int8") for p in precisions):
        log(f"stagewise bench: --linear-precision takes exact and/or int8, got {args.linear_precision!r}")
        return 2
    if args.tpot_target not in ("auto", "none"):
        try:
            if tpot_target_problem(float(args.tpot_target), "--tpot-target") is not None:
                raise ValueError
        except ValueError:
            log(f"stagewise bench: --tpot-target takes auto, none or milliseconds > 0, got {args.tpot_target!r}")
            return 2
    try:
        stages = int(args.stages or 1)
        if stages < 1:
            raise ValueError
    except ValueError:
        log(f"stagewise bench: serve --stages takes one number of stages >= 1, got {args.stages!r}")
        return 2
    from stagewise.kv.cache import KV_CACHE_DTYPES

    kv_dtypes = [k.strip() for k in args.kv_cache_dtype.split(",") if k.strip()]
    if not kv_dtypes or any(k not in KV_CACHE_DTYPES for k in kv_dtypes):
        log(f"stagewise bench: --kv-cache-dtype takes {', '.join(KV_CACHE_DTYPES)} (several: comma-separated), got "
            f"{args.kv_cache_dtype!r}")
        return 2
    caches = [c.strip() for c in args.prefix_cache.split(",") if c.strip()]
    if not caches or any(c not in ("on", "off") for c in caches):
        log(f"stagewise bench: --prefix-cache takes on and/or off, got {args.prefix_cache!r}")
        return 2
    n = args.requests or (4 if args.tiny else 40)
    shapes = (Shape(12, 0.3, 4, 24), Shape(4, 0.3, 2, 8)) if args.tiny else (PROMPT, OUTPUT)
    sizes = TINY if args.tiny else Sizes()
    from stagewise.launch.local import usable_cores

    cores = usable_cores()
    threads = args.threads or cores
    ckpt = open_checkpoint(args.model)
    tok = ckpt.tokenizer()
    tokenize = (lambda text: len(tok.encode(text).ids))
    baselines = [b.strip() for b in args.baseline_server.split(",") if b.strip() and b.strip() != "none"]
    if any(b not in ("llama.cpp", "vllm") for b in baselines):
        log(f"stagewise bench: --server-baseline takes llama.cpp, vllm (both: llama.cpp,vllm) or none, "
            f"got {args.baseline_server!r}")
        return 2
    if baselines and ckpt.path.suffix != ".gguf":
        log(f"stagewise bench: the baseline servers need a GGUF model, got {str(ckpt.path)!r}")
        return 2
    if "vllm" in baselines:
        from stagewise.bench import vllm_cpu

        try:
            vllm_python = vllm_cpu.find_python(args.vllm_python)
        except ValueError as err:
            log(f"stagewise {err}")
            return 2
    env = dict(os.environ)
    rows: dict[str, list[dict]] = {}
    info = report.machine_info("cpu")
    info.update(model=str(ckpt.path), threads=threads, cores=cores,
                stagewise_threads=args.threads or "its default (on the CPU every core, one fewer for a step of one token)",
                requests_per_rate=n, rates=rates, stages=stages, workload=args.workload, kv_cache_dtypes=kv_dtypes,
                prompt_median=shapes[0].median, output_median=shapes[1].median)

    def measure(name: str, server: Server, model: str, extra: dict) -> None:
        info[f"{name}_ready_s"] = round(server.ready_s, 2)
        try:
            warm = workload("sharegpt", 2, 1.0, tokenize, seed=99)
            asyncio.run(run_load(server.url, model, warm, 1.0, extra))
            for i, rate in enumerate(rates):
                requests = workload(args.workload, n, rate, tokenize, seed=i, prompt=shapes[0], output=shapes[1],
                                    sizes=sizes)
                row = asyncio.run(run_load(server.url, model, requests, rate, extra)).summary()
                row["requests"] = num_requests(requests)
                row["prompt_tokens_mean"] = sum(r.prompt_tokens for r in requests) / len(requests)
                row["max_tokens_mean"] = sum(r.max_tokens for r in requests) / len(requests)
                rows.setdefault(name, []).append(row)
                log(f"  {name} at {rate:g} req/s: {row['req_per_s']:.2f} req/s, {row['tok_per_s']:.1f} tok/s, "
                    f"TTFT p50/p99 {_ms(row['ttft_p50_s'])}/{_ms(row['ttft_p99_s'])} ms, TPOT p50/p99 "
                    f"{_ms(row['tpot_p50_s'])}/{_ms(row['tpot_p99_s'])} ms, prefix-cache hits "
                    f"{_pct(row['cache_hit_rate'])}, {row['failed']} failed")
        finally:
            server.stop()

    if "llama.cpp" in baselines:  # first: its budget sets ours' target
        server = _llama_cpp(ckpt.path, threads, env, args.install_baseline, log, args.workload in PROMPT_CACHE)
        info["llama_cpp_python"] = server.version
        measure("llama.cpp", server, str(ckpt.path), {"logit_bias": {str(t): -100.0 for t in ckpt.config.eos_token_ids}})
    if "vllm" in baselines:
        folder = vllm_cpu.hf_folder(ckpt.path, log=log)
        argv, extra_env = vllm_cpu.server_argv(vllm_python, folder, args.model, _free_port(), threads)
        info["vllm"] = vllm_cpu.version(vllm_python)
        measure("vLLM", Server("vLLM", argv, "/health", {**env, **extra_env}), args.model, {"ignore_eos": True})
    target = _target(args, rows)
    info["tpot_target_ms"], info["tpot_target_auto"] = target, args.tpot_target == "auto"
    runs = [(precisions[0], None, cache == "on", kv_dtypes[0]) for cache in caches]
    runs += [(p, target, caches[0] == "on", kv) for kv in kv_dtypes for p in precisions] if target is not None else []
    for precision, target_ms, cache, kv in runs:
        measure(_name(precision, target_ms, stages, cache, kv),
                _ours(args.model, args.threads, env, precision, target_ms, stages, cache, kv), args.model,
                {"ignore_eos": True})
    compare = _budget_compare(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{info['device']}-serve"
    stem.with_suffix(".json").write_text(json.dumps({"machine": info, "rows": rows, "compare": compare}, indent=1))
    _markdown(stem.with_suffix(".md"), info, rows, compare)
    log(f"wrote {stem}.md and .json")
    return 0 if all(r["failed"] == 0 for rs in rows.values() for r in rs) else 1


WORKLOAD_LINES = {
    "sharegpt": "log-normal prompt (median {prompt_median:g} tokens) and output (median {output_median:g}) lengths",
    "system-prompt": "one system prompt of 1,024 tokens before each short question",
    "multi-turn": "chats of 4 turns, each resending the conversation with the answers so far",
    "documents": "8 questions about each 2,000-token document, mixed",
}
"""What each workload is, for the report (``--tiny`` makes every size smaller)."""


def _cache_lines(rows: dict[str, list[dict]]) -> list[str]:
    """Each run with the prefix cache against the same run without it, rate by rate: TTFT p50 and
    requests per second, the ratio of the two."""
    out = []
    for name, rs in rows.items():
        off = rows.get(f"{name}, no prefix cache")
        if not off:
            continue
        out += ["", f"{name} against itself without the prefix cache (cache off / on TTFT p50, on / off req/s):", ""]
        for on_row, off_row in zip(rs, off):
            ttft = (off_row["ttft_p50_s"] / on_row["ttft_p50_s"]) if on_row["ttft_p50_s"] and off_row["ttft_p50_s"] \
                else None
            rps = on_row["req_per_s"] / off_row["req_per_s"] if off_row["req_per_s"] else None
            out.append(f"- at {on_row['rate']:g} req/s: TTFT p50 {_ms(on_row['ttft_p50_s'])} vs "
                       f"{_ms(off_row['ttft_p50_s'])} ms (" + ("-" if ttft is None else f"**{ttft:.1f}x** lower")
                       + f"), {on_row['req_per_s']:.2f} vs {off_row['req_per_s']:.2f} req/s ("
                       + ("-" if rps is None else f"**{rps:.2f}x**") + ")")
    return out


def _ms(v) -> str:
    return "-" if v is None else f"{1e3 * v:.0f}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def _markdown(path: Path, info: dict, rows: dict[str, list[dict]], compare: dict | None) -> None:
    ready = ", ".join(f"{name} {info[f'{name}_ready_s']} s" for name in rows if f"{name}_ready_s" in info)
    target = info.get("tpot_target_ms")
    lines = ["# `stagewise serve` against " + ("llama.cpp's and vLLM's OpenAI servers" if "vllm" in info
                                              else "llama.cpp's OpenAI server"), "",
             f"Machine: {info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, {report.isa_line(info)}; "
             f"torch {info['torch']}; the whole machine per server, one after the other: llama.cpp "
             f"{info['threads']} threads, stagewise {info['stagewise_threads']}  ",
             f"Date (UTC): {info['date_utc']}; commit {info['git_commit']}  ",
             f"Model: {info['model']}; {info['requests_per_rate']} streamed completions per rate, Poisson arrivals; "
             f"workload {info['workload']} (" + WORKLOAD_LINES[info["workload"]].format(**info) + "); every requested "
             "token generated  ",
             "; ".join(([f"llama-cpp-python {info['llama_cpp_python']} (its server reuses the previous prompt's "
                         "common prefix" + ("; with its RAM prompt cache" if info["workload"] in PROMPT_CACHE else "")
                         + ")"] if "llama_cpp_python" in info else [])
                       + ([f"vLLM {info['vllm']} (CPU backend, float32, automatic prefix caching)"] if "vllm" in info
                          else []) + [f"ready after: {ready}  "]),
             "stagewise's TPOT target (`serve --tpot-target`): " + ("none" if target is None else f"{target:g} ms"
             + (f" ({HEADROOM:g} of llama.cpp's budget below)" if info.get("tpot_target_auto") else "")) + "; linear precisions: exact "
             "(float32 on the exact dequantised weights) and int8 (activations quantised to int8 per block of 32, "
             "as llama.cpp's CPU path does)", "",
             "| server | offered req/s | served req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
             "TPOT p99 ms | prefix-cache hits | failed |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rs in rows.items():
        for r in rs:
            lines.append(f"| {name} | {r['rate']:g} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} | {_ms(r['ttft_p50_s'])} "
                         f"| {_ms(r['ttft_p99_s'])} | {_ms(r['tpot_p50_s'])} | {_ms(r['tpot_p99_s'])} "
                         f"| {_pct(r.get('cache_hit_rate'))} | {r['failed']} |")
    lines += _cache_lines(rows)
    if compare:
        lines += ["", f"At equal p99 TPOT (the budget: llama.cpp's p99 TPOT at its best rate, "
                      f"{_ms(compare['tpot_p99_budget_s'])} ms), llama.cpp serves {compare['llama_cpp_req_per_s']:.2f} "
                      "req/s; each other server its best within the budget:", ""]
        for name, c in compare["servers"].items():
            at = f"{c['req_per_s']:.2f} req/s (at {c['rate']:g} offered)" if c["rate"] is not None else \
                "no rate measured here"
            lines.append(f"- {name}: {at}: **{c['ratio']:.2f}x**")
    base = max(rows.get("llama.cpp", []), key=lambda r: r["req_per_s"], default=None)
    if base is not None:
        lines += ["", "Most requests served per second, whatever the latency: llama.cpp "
                      f"{base['req_per_s']:.2f} (TTFT p50 {_ms(base['ttft_p50_s'])} ms, TPOT p99 "
                      f"{_ms(base['tpot_p99_s'])} ms)"]
        for name, rs in rows.items():
            if name != "llama.cpp" and rs:
                top = max(rs, key=lambda r: r["req_per_s"])
                lines.append(f"- {name}: {top['req_per_s']:.2f} (TTFT p50 {_ms(top['ttft_p50_s'])} ms, TPOT p99 "
                             f"{_ms(top['tpot_p99_s'])} ms): {top['req_per_s'] / base['req_per_s']:.2f}x")
    path.write_text("\n".join(lines) + "\n")

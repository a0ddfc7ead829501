"""The compact KV cache's bytes and decode speed against the cache in the activations' dtype, and
beside llama.cpp with its KV cache in f16 and in q8_0.

Bytes: a token's K and V over every layer, scales included, from the cache's own spec (what the
engine allocates), and the rows of ``--context`` tokens that fit a 1 GiB budget.

Speed: ``--batch`` rows each holding ``--context`` tokens (random token ids, the same for every
engine; prefilled once per engine), then decode steps timed at each of ``--decode-threads``, the
engines taking turns step group by step group so that the machine's drift falls on all alike; the
median step. Where attention dominates (a long context and a batch) the cache's bytes decide the
step. Batch 1 over a short context checks that nothing else got slower.
"""

from __future__ import annotations

import statistics
import time

import torch

BUDGET = 1 << 30
"""The KV budget the fitting batch is counted in."""
GROUPS = 5
"""Step groups timed per engine and thread count, taking turns."""


def _random_prompts(rows: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(100, vocab - 100, (rows, length), generator=g).tolist()


class _Ours:
    """An engine over the stage, its rows prefilled, stepped one decode step at a time."""

    def __init__(self, stage, kv: str, prompts: list[list[int]], new_tokens: int) -> None:
        from stagewise.engine.engine import Engine
        from stagewise.engine.params import SamplingParams

        length = len(prompts[0]) + new_tokens + 1
        self.engine = Engine.for_model(stage, max_num_seqs=len(prompts), max_model_len=length, prefix_cache=False,
                                       max_num_tokens=len(prompts) * length, kv_cache_dtype=kv)
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0)
        for i, p in enumerate(prompts):
            self.engine.add_request(i, p, params)
        start = time.perf_counter()
        while any(self.engine.requests.first_token_s(i) is None for i in range(len(prompts))):
            self.engine.step()
        self.prefill_s = time.perf_counter() - start

    def steps(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            self.engine.step()
            out.append(time.perf_counter() - t)
        return out


class _Llama:
    """llama.cpp on the same GGUF, its rows prefilled, stepped one decode step at a time."""

    def __init__(self, lib, path, kv: str, prompts: list[list[int]], new_tokens: int, threads: int) -> None:
        from stagewise.bench.llama_cpp import LlamaCpp

        self.lib, self.prompts = lib, prompts
        self.engine = LlamaCpp(lib, path, threads, len(prompts), len(prompts[0]) + new_tokens + 1, kv_type=kv)
        start = time.perf_counter()
        self.last = self.engine.prefill(prompts)
        self.prefill_s = time.perf_counter() - start
        self.done = 0

    def steps(self, n: int, threads: int) -> list[float]:
        self.lib.llama_set_n_threads(self.engine.ctx, threads, threads)
        out = []
        for _ in range(n):
            t = time.perf_counter()
            self.last = self.engine.step(self.last, [len(p) + self.done for p in self.prompts])
            self.done += 1
            out.append(time.perf_counter() - t)
        return out

    def close(self) -> None:
        self.engine.close()


def _bytes(cfg, dtypes: list[str], context: int) -> dict:
    from stagewise.kv.cache import num_cache_blocks
    from stagewise.model.stage import cache_spec

    rows = {}
    for kv in ["auto", *dtypes]:
        spec = cache_spec(cfg, 0, cfg.num_layers, tp_size=1, block_size=16, dtype=torch.float32, kv_cache_dtype=kv)
        blocks = num_cache_blocks(spec, "cpu", max_num_seqs=1 << 16, max_model_len=context, kv_cache_bytes=BUDGET)
        rows[kv] = {"bytes_per_token": spec.bytes_per_block() // spec.block_size,
                    "rows_in_budget": blocks * spec.block_size // context}
    for kv in dtypes:
        rows[kv]["bytes_ratio"] = rows[kv]["bytes_per_token"] / rows["auto"]["bytes_per_token"]
        rows[kv]["rows_ratio"] = rows[kv]["rows_in_budget"] / max(1, rows["auto"]["rows_in_budget"])
    return rows


def _timed(ours: dict, llama: dict, threads: list[int], steps: int, log) -> dict:
    """Median decode step (seconds) of each engine at each thread count, the engines taking turns."""
    times: dict[tuple[str, int], list[float]] = {}
    for group in range(GROUPS):
        for t in threads:
            for name, eng in ours.items():
                torch.set_num_threads(t)
                times.setdefault((name, t), []).extend(eng.steps(steps)[1:])  # the first: after a switch
            for name, eng in llama.items():
                times.setdefault((name, t), []).extend(eng.steps(steps, t)[1:])
        log(f"bench kv: step group {group + 1}/{GROUPS} timed")
    return {key: statistics.median(v) for key, v in times.items()}


def run_decode(args, dtypes: list[str], info: dict, log) -> tuple[dict, list[str]]:
    from stagewise.bench import report
    from stagewise.model.loader import open_checkpoint
    from stagewise.model.stage import load_stage

    ckpt = open_checkpoint(args.model)
    cfg = ckpt.config
    batch, context = (2, 256) if args.tiny else (args.batch, args.context)
    threads = [1] if args.tiny else [int(t) for t in args.decode_threads.split(",")]
    steps = 3 if args.tiny else 6
    new_tokens = GROUPS * len(threads) * steps + 2
    sizes = _bytes(cfg, dtypes, context)
    stage = load_stage(ckpt, 0, cfg.num_layers, dtype="auto")
    lib = None
    if args.baseline == "llama.cpp" and str(getattr(ckpt, "path", "")).endswith(".gguf"):
        from stagewise.bench.llama_cpp import find_or_install

        lib = find_or_install(args.install_baseline, log, suite="kv")
    cases = {"long": (batch, context - new_tokens - 1), "short": (1, 64)}
    results = {}
    for case, (rows, prompt_len) in cases.items():
        prompts = _random_prompts(rows, prompt_len, cfg.vocab_size)
        log(f"bench kv: {case}: {rows} rows of {prompt_len} prompt tokens, prefilling each engine")
        ours = {f"stagewise {kv}": _Ours(stage, kv, prompts, new_tokens) for kv in ["auto", *dtypes]}
        llama = {} if lib is None else {f"llama.cpp {kv}": _Llama(lib, ckpt.path, kv, prompts, new_tokens,
                                                                   max(threads)) for kv in ("f16", "q8_0")}
        try:
            med = _timed(ours, llama, threads, steps, log)
        finally:
            for eng in llama.values():
                eng.close()
        results[case] = {"rows": rows, "context": prompt_len, "prefill_s": {
            name: round(e.prefill_s, 2) for name, e in {**ours, **llama}.items()},
            "tokens_per_s": {f"{name} t{t}": rows / s for (name, t), s in med.items()}}
        del ours
    data = {"model": args.model, "batch": batch, "context": context, "threads": threads, "bytes": sizes,
            "decode": results}
    return data, _report(data, dtypes, info, report)


def _report(data: dict, dtypes: list[str], info: dict, report) -> list[str]:
    lines = ["# The compact KV cache: bytes and decode speed", "",
             f"Machine: {info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, {report.isa_line(info)}; "
             f"torch {info['torch']}  ", f"Date (UTC): {info['date_utc']}; commit {info['git_commit']}  ",
             f"Model: {data['model']} (float32 activations); engines take turns, {GROUPS} step groups each, "
             "median step", "",
             f"## Bytes per token (every layer's K and V, scales included) and rows of {data['context']} tokens "
             "in 1 GiB", "", "| kv_cache_dtype | bytes per token | of float32 | rows in 1 GiB | of float32 |",
             "|---|---:|---:|---:|---:|"]
    for kv, row in data["bytes"].items():
        lines.append(f"| {kv} | {row['bytes_per_token']} | {row.get('bytes_ratio', 1.0):.3f} | "
                     f"{row['rows_in_budget']} | {row.get('rows_ratio', 1.0):.2f}x |")
    for case, res in data["decode"].items():
        lines += ["", f"## Decode, {res['rows']} rows of {res['context']} prompt tokens", "",
                  "| engine | threads | tokens/s | against stagewise auto | prefill s |", "|---|---:|---:|---:|---:|"]
        for key, tps in res["tokens_per_s"].items():
            name, t = key.rsplit(" t", 1)
            base = res["tokens_per_s"].get(f"stagewise auto t{t}")
            lines.append(f"| {name} | {t} | {tps:.1f} | {tps / base:.2f}x | {res['prefill_s'][name]} |")
        for t in data["threads"]:
            tps = res["tokens_per_s"]
            for kv in dtypes:
                if f"llama.cpp q8_0 t{t}" in tps:
                    lines.append(f"\n{t} thread(s): stagewise {kv} / llama.cpp q8_0 = "
                                 f"**{tps[f'stagewise {kv} t{t}'] / tps[f'llama.cpp q8_0 t{t}']:.2f}x**; "
                                 f"stagewise {kv} / stagewise auto = "
                                 f"**{tps[f'stagewise {kv} t{t}'] / tps[f'stagewise auto t{t}']:.2f}x**")
    return lines

"""``stagewise bench kv``: the compact KV cache (``kv_cache_dtype`` int8 / fp8_e4m3) against the
cache in the activations' dtype, side by side in one run: its bytes per token and the batch that
fits a fixed budget at a long context (:mod:`~stagewise.bench.kv.decode`), decode tokens/s where
attention dominates (batch 16 at a 4k context, one and two threads) and at batch 1 over a short
one, each beside llama.cpp with its KV cache in f16 and in q8_0 on the same GGUF; and its error
(:mod:`~stagewise.bench.kv.accuracy`): logprobs against the float cache at 1k and 8k tokens,
greedy agreement on chat questions, a perplexity delta on a fixed public-domain text, beside
llama.cpp's q8_0 cache on the same text."""

from __future__ import annotations

import argparse

from stagewise.bench.options import add_common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "kv")
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF file or smollm2-135m (default)")
    parser.add_argument("--kv-cache-dtype", default="int8", metavar="int8,fp8_e4m3",
                        help="the compact caches measured against auto (default int8)")
    parser.add_argument("--batch", type=int, default=16, help="rows of the long-context decode (default 16)")
    parser.add_argument("--context", type=int, default=4096, help="tokens each row holds (default 4096)")
    parser.add_argument("--decode-threads", default="1,2", metavar="1,2",
                        help="thread counts the decode is timed at (default 1,2)")
    parser.add_argument("--parts", default="decode,accuracy", metavar="decode,accuracy",
                        help="what to run: decode (bytes and speed), accuracy (default both)")
    parser.add_argument("--baseline", default="llama.cpp", choices=("llama.cpp", "none"),
                        help="llama.cpp (llama-cpp-python) beside ours, its cache in f16 and q8_0 (default)")
    parser.add_argument("--install-baseline", action="store_true",
                        help="pip install llama-cpp-python (a native source build) when it is missing")


def run(args: argparse.Namespace, log) -> int:
    from stagewise.bench import report

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - {"decode", "accuracy"})
    if unknown or not parts:
        log(f"bench kv: --parts takes decode and/or accuracy, got {args.parts!r}")
        return 2
    dtypes = [d.strip() for d in args.kv_cache_dtype.split(",") if d.strip()]
    if not dtypes or any(d not in ("int8", "fp8_e4m3") for d in dtypes):
        log(f"bench kv: --kv-cache-dtype takes int8 and/or fp8_e4m3, got {args.kv_cache_dtype!r}")
        return 2
    info = report.machine_info("cpu")
    for part in parts:
        if part == "decode":
            from stagewise.bench.kv.decode import run_decode as measure
        else:
            from stagewise.bench.kv.accuracy import run_accuracy as measure
        data, lines = measure(args, dtypes, info, log)
        report.write_results(args.out, f"{info['device']}-kv-{part}", {"machine": info, **data}, lines, log)
    return 0

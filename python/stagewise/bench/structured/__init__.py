"""``stagewise bench structured``: what structured output costs.

- **The grammar engines** side by side (:mod:`~stagewise.bench.structured.engines`): llguidance
  (the runtime's) and, when importable, xgrammar: the vocabulary's set-up, compiling a 20-field
  schema, the per-token mask at batch 1 and 16 along a valid answer, and how many of a set of
  schemas each compiles.
- **The runtime** (:mod:`~stagewise.bench.structured.decode`): SmolLM2's decode time per token at
  batch 1 and 16, the same requests with and without a JSON schema that never completes within the
  measured tokens, alternating runs; the ratio is what the mask costs.
"""

from __future__ import annotations

import argparse

from stagewise.bench.options import add_common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, "structured")
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF file, an HF folder or smollm2-135m (default)")
    parser.add_argument("--batch-sizes", default="1,16", metavar="1,16", help="decode batch sizes (default 1,16)")
    parser.add_argument("--tokens", type=int, default=None, metavar="N",
                        help="tokens generated per request (default 64; --tiny: 8)")
    parser.add_argument("--repeats", type=int, default=None, metavar="R",
                        help="runs of each, alternating, the median kept (default 5; --tiny: 1)")
    parser.add_argument("--linear-precision", default="int8", choices=("exact", "int8"),
                        help="the model's linears (default int8)")


def run(args: argparse.Namespace, log) -> int:
    from stagewise.bench import report
    from stagewise.bench.structured import decode, engines

    info = report.machine_info("cpu")
    info.update(model=args.model, threads=args.threads)
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        log(f"stagewise bench: --batch-sizes takes batch sizes >= 1 such as 1,16, got {args.batch_sizes!r}")
        return 2
    tokens = args.tokens or (8 if args.tiny else 64)
    repeats = args.repeats or (1 if args.tiny else 5)
    engine_rows = engines.measure(args.model, sizes, tiny=args.tiny, log=log)
    decode_rows = decode.measure(args.model, sizes, tokens, repeats, args.linear_precision, log=log)
    data = {"machine": info, "engines": engine_rows, "decode": decode_rows}
    lines = engines.markdown(info, engine_rows) + [""] + decode.markdown(decode_rows, tokens, repeats)
    report.write_results(args.out, f"{info['device']}-structured", data, lines, log=log)
    return 0

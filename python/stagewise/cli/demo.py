"""``stagewise demo`` (what ``make demo`` runs): SmolLM2-135M-Instruct as a 3-stage pipeline on this
machine.

Three stage processes (layers split by the ``balanced`` policy), connected over the default
transport, answer a question with streamed text; then a table per stage (layers, busy %,
bytes sent) and the decode speed.
"""

from __future__ import annotations

import argparse
import sys
import time

from stagewise import startup_gc
from stagewise.engine.params import SamplingParams

QUESTION = "What is the capital of France? Answer in one sentence, then name two famous landmarks there."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the model (default smollm2-135m)")
    parser.add_argument("--stages", type=int, default=3, help="pipeline stages, one process each (default 3)")
    parser.add_argument("--partition", default="balanced", help="how the layers are split (default balanced)")
    parser.add_argument("--transport", default="auto", help="how stages pass activations (default auto)")
    parser.add_argument("--question", default=QUESTION, help="what to ask")
    parser.add_argument("--max-new-tokens", type=int, default=SamplingParams().max_new_tokens, metavar="N",
                        help="most tokens of the answer (default: the sampling default, %(default)s)")


def run(args: argparse.Namespace) -> int:
    startup_gc.pause()  # until the pipeline is up: see stagewise.startup_gc
    import stagewise

    print(f"stagewise demo: {args.model} as a {args.stages}-stage pipeline ({args.partition} partition, "
          f"transport {args.transport}); starting the stage processes ...", flush=True)
    start = time.perf_counter()
    with stagewise.Pipeline(args.model, stages=args.stages, partition=args.partition, transport=args.transport,
                            max_model_len=1024, max_num_seqs=4) as pipe:
        startup_gc.settle()
        print(f"ready in {time.perf_counter() - start:.1f} s; layers per stage: {pipe.plan.stage_plan}\n", flush=True)
        print(f"> {args.question}\n", flush=True)

        def stream(_index: int, text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        [answer] = pipe.generate([args.question], chat=True, max_new_tokens=args.max_new_tokens, on_text=stream)
        stats = pipe.last_stats
    print(f"\n\n[{answer.finish_reason}, {len(answer.token_ids)} tokens]\n")
    rows = [("stage", "layers", "busy %", "steps", "bytes sent", "send ms", "recv-wait ms")]
    for s in stats["stages"]:
        rows.append((str(s["stage"]), f"{s['layers'][0]}-{s['layers'][1]}", f"{100 * s['busy_fraction']:.1f}",
                     str(s["steps"]), f"{s['bytes_sent']:,}", f"{1e3 * s['send_s']:.1f}",
                     f"{1e3 * s['recv_wait_s']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(f"\ntime to first token {1e3 * stats['ttft_s']:.0f} ms; decode {stats['decode_tokens_per_s']:.1f} tokens/s "
          f"({stats['decode_tokens']} tokens in {stats['decode_s']:.2f} s)")
    return 0 if answer.finish_reason in ("stop", "length") else 1

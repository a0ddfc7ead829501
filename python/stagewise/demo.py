"""``make demo``: SmolLM2-135M-Instruct as a 3-stage pipeline on this machine.

Three stage processes (layers split by the ``balanced`` policy), connected over the default
transport, answer a question with streamed text; then a table per stage (layers, busy %,
bytes sent) and the decode speed.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stagewise.demo", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--partition", default="balanced")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--question", default="What is the capital of France? Answer in one sentence, then "
                                              "name two famous landmarks there.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    from stagewise import heap

    heap.pause()  # until the pipeline is up: see stagewise.heap
    import stagewise

    print(f"stagewise demo: {args.model} as a {args.stages}-stage pipeline ({args.partition} partition, "
          f"transport {args.transport}); starting the stage processes ...", flush=True)
    start = time.perf_counter()
    with stagewise.Pipeline(args.model, stages=args.stages, partition=args.partition, transport=args.transport,
                            max_model_len=1024, max_num_seqs=4) as pipe:
        heap.settle()
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


if __name__ == "__main__":
    sys.exit(main())

"""``stagewise generate``: load a model in this process and generate for one or more prompts.

Plain output streams each prompt's text as it is generated; ``--json`` prints one
object ``{"completions": [{"text", "token_ids", "finish_reason"}], "stats": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import sys

from stagewise.transport.select import TRANSPORTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="an HF folder, a .gguf file, or an embedded model name (smollm2-135m); "
                             "with --plan, the plan's model")
    add_prompt_arguments(parser)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--linear-precision", default="exact", choices=["exact", "int8"],
                        help="GGUF block-quantised linears: exact float32 maths (default) or int8 activations "
                             "(approximate, faster decode on the CPU; tokens may differ from the exact model's)")
    parser.add_argument("--max-num-seqs", type=int, default=32, metavar="N", help="requests run at once")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="most tokens (prompt + generated) per request; default: the model's")
    pp = parser.add_argument_group("pipeline (stages as processes)")
    pp.add_argument("--stages", type=int, default=1, metavar="S", help="pipeline stages, one process each")
    pp.add_argument("--partition", default="even", metavar="P",
                    help="even | ceil | balanced | explicit ranges such as 0-10,10-22,22-30")
    pp.add_argument("--transport", default="auto", choices=TRANSPORTS,
                    help="how stages pass activations (auto: shared memory on one host, tcp across hosts)")
    pp.add_argument("--no-checksum", action="store_true", help="skip frame checksums (on by default)")
    pp.add_argument("--auth-token", default=None, metavar="TOKEN",
                    help="shared secret for stage connections (default: $STAGEWISE_AUTH_TOKEN)")
    pp.add_argument("--trace", default=None, metavar="FILE.json",
                    help="write a Chrome-trace timeline of the stages (open in Perfetto)")
    mh = parser.add_argument_group("stages already running (see docs/multi-host.md)")
    mh.add_argument("--plan", default=None, metavar="PLAN.yaml",
                    help="attach to the stages of this run plan instead of starting any")
    mh.add_argument("--store", default=None, metavar="HOST:PORT",
                    help="with --plan: read the stages' addresses from torch.distributed's store (torchrun's "
                         "MASTER_ADDR:MASTER_PORT) instead of the plan's listen addresses")
    mh.add_argument("--connect-timeout", type=float, default=60.0, metavar="S",
                    help="with --plan: how long to wait for the stages (default 60)")


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                        help="a prompt (repeat for several, generated as one batch)")
    parser.add_argument("--prompt-ids", action="append", default=[], metavar="1,2,3", type=_ids,
                        help="a prompt as comma-separated token ids (repeatable; not with --prompt)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1 = off")
    parser.add_argument("--seed", type=int, default=None, metavar="S")
    parser.add_argument("--stop", action="append", default=[], metavar="S", help="a stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def check_prompts(args: argparse.Namespace, prog: str = "stagewise generate") -> str | None:
    """The reason the prompt arguments cannot work, or None."""
    if bool(args.prompt) == bool(args.prompt_ids):
        return f"{prog}: give --prompt TEXT or --prompt-ids 1,2,3 (not both)"
    if args.prompt_ids and args.chat:
        return f"{prog}: --chat needs --prompt TEXT, not --prompt-ids"
    return None


def run(args: argparse.Namespace) -> int:
    problem = check_prompts(args)
    if problem is None and (args.model is None) == (args.plan is None):
        problem = "stagewise generate: give a model, or --plan PLAN to attach to running stages (not both)"
    if problem is None and args.store and not args.plan:
        problem = "stagewise generate: --store needs --plan"
    if problem is None and args.plan and args.stages > 1:
        problem = "stagewise generate: --stages starts local stages; with --plan the plan's stages are used"
    if problem is None and args.trace and args.stages == 1 and not args.plan:
        problem = "stagewise generate: --trace needs --stages > 1"
    if problem:
        print(problem, file=sys.stderr)
        return 2
    pipe = _attach(args) if args.plan else _load(args)
    if pipe is None:
        return 1
    return generate_and_print(pipe, args, prog="stagewise generate")


def _attach(args: argparse.Namespace):
    import os

    from stagewise.api import Pipeline

    token = args.auth_token or os.environ.get("STAGEWISE_AUTH_TOKEN") or None
    try:
        return Pipeline.attach(args.plan, store=args.store, auth_token=token, connect_timeout=args.connect_timeout)
    except (ValueError, FileNotFoundError, KeyError, RuntimeError, TimeoutError, OSError) as err:
        print(f"stagewise generate: cannot attach to the stages of {args.plan!r}: {err}", file=sys.stderr)
        return None


def _load(args: argparse.Namespace):
    from stagewise.api import Pipeline

    # Loading takes seconds; show a progress bar on a terminal (stderr, so piped output stays clean).
    chatty = sys.stderr.isatty()
    bar = _LoadBar(f"stagewise: loading {args.model} on {args.device}") if chatty else None
    options = {}
    if args.stages > 1:
        import os

        options = dict(partition=args.partition, transport=args.transport, checksum=not args.no_checksum,
                       auth_token=args.auth_token or os.environ.get("STAGEWISE_AUTH_TOKEN") or None)
        bar = None  # the stages load in their own processes
    try:
        try:
            pipe = Pipeline(args.model, stages=args.stages, device=args.device, dtype=args.dtype,
                            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, load_progress=bar,
                            linear_precision=args.linear_precision, **options)
        finally:  # before any message, so that the bar's line is finished first
            if bar is not None:
                bar.close()
    except (ValueError, FileNotFoundError, KeyError, RuntimeError, TimeoutError, OSError, NotImplementedError) as err:
        print(f"stagewise generate: cannot load {args.model!r}: {err}", file=sys.stderr)
        return None
    if chatty:
        print(f"stagewise: loaded {args.model} in {pipe.load_s:.1f} s ({pipe.config.num_layers} layers, "
              f"{str(pipe.dtype).removeprefix('torch.')})", file=sys.stderr)
    return pipe


def generate_and_print(pipe, args: argparse.Namespace, *, prog: str, close: bool = True) -> int:
    """Generate for the prompts of ``args`` and print them (streamed text or ``--json``);
    closes ``pipe`` afterwards unless ``close`` is False."""
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat)
    if args.prompt:
        kwargs["prompts"] = args.prompt
    else:
        kwargs["prompt_token_ids"] = args.prompt_ids
    stream = None if args.json else _Streamer(len(args.prompt or args.prompt_ids))
    trace = getattr(args, "trace", None)
    try:
        try:
            completions = pipe.generate(**kwargs, on_text=None if stream is None else stream)
            stats = {"load_s": pipe.load_s, **pipe.last_stats}
            if trace:
                pipe.write_trace(trace)
        finally:
            if close:
                pipe.close()
    except ValueError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    if args.json:
        out = {"completions": [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                                **({"error": c.error} if c.error else {})} for c in completions],
               "stats": stats}
        print(json.dumps(out), flush=True)
    else:
        stream.finish(completions)
    return 1 if any(c.finish_reason == "error" for c in completions) else 0


class _LoadBar:
    """A tqdm bar on stderr over the tensors read; the bytes read so far are shown after it."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.bar = None

    def __call__(self, done: int, total: int, nbytes: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.description, unit="tensor", file=sys.stderr)
        self.bar.set_postfix_str(f"{nbytes / 2**20:.0f} MiB", refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Streamer:
    """Prints text as it arrives. One prompt streams live; with several, each prompt's text is
    printed as a block once it is complete (their tokens arrive interleaved)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, index: int, text: str) -> None:
        if self.n == 1:
            sys.stdout.write(text)
            sys.stdout.flush()

    def finish(self, completions) -> None:
        for i, c in enumerate(completions):
            if self.n > 1:
                sys.stdout.write(f"--- [{i}] {c.finish_reason}\n{c.text}")
            if c.error:
                print(f"\nstagewise generate: prompt {i}: {c.error}", file=sys.stderr)
            sys.stdout.write("\n")
        sys.stdout.flush()

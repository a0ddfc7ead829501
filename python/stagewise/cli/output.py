"""How ``generate`` and ``launch`` print results: text streamed as it comes, ``--json`` (one object
``{"completions": [...], "stats": {...}}``), or one JSON line per request of a prompt file
(``index``, 0-based among the requests; ``line``, its line in the file; ``text``, ``token_ids``,
``finish_reason`` and, where they apply, ``error`` and ``logprobs``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from stagewise.cli.prompt_args import PromptBatch
from stagewise.cli.sampling import sampling_args


def generate_and_print(pipe, args: argparse.Namespace, batch: PromptBatch, *, prog: str, close: bool = True,
                       label: str | None = None) -> int:
    """Generate for ``batch`` and print the results (streamed text, ``--json`` or JSON lines);
    closes ``pipe`` afterwards unless ``close`` is False. ``label`` heads the streamed answer
    (``stagewise launch`` names the input line)."""
    plan_sampling = getattr(pipe.plan, "sampling", None) if pipe.plan is not None else None
    kwargs = dict(sampling_args(args, plan_sampling), chat=args.chat,
                  overrides=batch.overrides if batch.from_file else None)
    kwargs.update(prompts=batch.texts) if batch.texts else kwargs.update(prompt_token_ids=batch.ids)
    if getattr(args, "image", None):
        kwargs["images"] = [list(args.image)] * len(batch)
    stream = None if args.json or batch.from_file else _Streamer(len(batch), label)
    trace = getattr(args, "trace", None)
    try:
        try:
            completions = pipe.generate(**kwargs, on_text=stream)
            stats = {"load_s": pipe.load_s, **pipe.last_stats}
            if trace:
                pipe.write_trace(trace)
        finally:
            if close:
                pipe.close()
    except ValueError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    if batch.from_file:
        for i, (c, line) in enumerate(zip(completions, batch.lines)):
            print(json.dumps(completion_json(c, index=i, line=line)), flush=True)
    elif args.json:
        print(json.dumps({"completions": [completion_json(c) for c in completions], "stats": stats}), flush=True)
    else:
        stream.finish(completions, prog)
    return 1 if any(c.finish_reason == "error" for c in completions) else 0


def completion_json(c, *, index: int | None = None, line: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {} if index is None else {"index": index}
    if line is not None:
        out["line"] = line
    out.update(text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason, cached_tokens=c.cached_tokens)
    if c.draft_tokens:
        out.update(draft_tokens=c.draft_tokens, accepted_tokens=c.accepted_tokens)
    if c.error:
        out["error"] = c.error
    if c.logprobs is not None:
        out["logprobs"] = [{"token": e.token, "logprob": e.logprob, "top": [[t, v] for t, v in e.top]}
                           if e is not None else None for e in c.logprobs]
    return out


class _Streamer:
    """Prints text as it arrives. One prompt streams live; with several, each prompt's text is
    printed as a block once it is complete (their tokens arrive interleaved). ``label`` heads a
    single prompt's answer (``--- label``)."""

    def __init__(self, n: int, label: str | None = None) -> None:
        self.n, self.label, self.started = n, label, False

    def __call__(self, index: int, text: str) -> None:
        if self.n == 1:
            self._head()
            sys.stdout.write(text)
            sys.stdout.flush()

    def _head(self) -> None:
        if self.label is not None and not self.started:
            sys.stdout.write(f"--- {self.label}\n")
        self.started = True

    def finish(self, completions, prog: str) -> None:
        for i, c in enumerate(completions):
            if self.n > 1:
                sys.stdout.write(f"--- [{i}] {c.finish_reason}\n{c.text}")
            else:
                self._head()
                if not c.text:
                    sys.stdout.write(f"(no text: {c.finish_reason}, {len(c.token_ids)} tokens)")
            if c.error:
                where = f"prompt {i}" if self.label is None else self.label
                print(f"\n{prog}: {where}: {c.error} (after {len(c.token_ids)} tokens)", file=sys.stderr)
            sys.stdout.write("\n")
        sys.stdout.flush()

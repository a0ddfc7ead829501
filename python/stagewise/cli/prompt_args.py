"""What ``stagewise generate`` and ``stagewise launch`` share about prompts: their arguments (the
sampling options among them: :mod:`stagewise.cli.sampling`), the prompt file, and the checks made
before anything loads.

Checks name every problem at once. Those that need no model run first, before torch is imported;
those that need the model read its config only (:func:`config_problems`).

A prompt file (``--prompt-file FILE.jsonl``) holds one request per line: ``{"prompt": "..."}`` or
``{"prompt_ids": [1, 2, 3]}``, with any sampling option beside it under its name (the field of
:class:`~stagewise.engine.params.SamplingParams`: ``max_new_tokens``, ``temperature``, ...,
``stop_token_ids``), which replaces the command line's for that line. The output is one JSON line
per request, in input order (:mod:`stagewise.cli.output`). Blank lines are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from stagewise.cli.sampling import add_sampling_arguments
from stagewise.engine.params import sampling_problems


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                         help="a prompt (repeat for several, generated as one batch)")
    prompts.add_argument("--prompt-ids", action="append", default=[], metavar="1,2,3",
                         help="a prompt as comma-separated token ids (repeatable)")
    prompts.add_argument("--prompt-file", default=None, metavar="FILE.jsonl",
                         help="one request per line, {\"prompt\": ...} or {\"prompt_ids\": [...]} with optional "
                              "sampling fields; prints one JSON line per request, in order")
    prompts.add_argument("--chat", action="store_true", help="wrap each text prompt in the model's chat template")
    prompts.add_argument("--image", action="append", default=[], metavar="FILE",
                         help="an image for the prompt (repeatable, in order; a vision model such as Qwen3-VL); "
                              "with several prompts each one gets them")
    add_sampling_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def negative_ids_fix(argv: list[str]) -> list[str]:
    """``--prompt-ids -1,2`` as ``--prompt-ids=-1,2``: argparse takes a value starting with '-'
    for an option, and the bad id deserves its own message."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--prompt-ids" and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1][1:2].isdigit():
            out.append(f"--prompt-ids={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


class PromptBatch:
    """The prompts of a command: text or ids, each with its sampling overrides (prompt file)."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.ids: list[list[int]] = []
        self.overrides: list[dict[str, Any] | None] = []
        self.lines: list[int | None] = []
        self.from_file = False

    def __len__(self) -> int:
        return len(self.texts) + len(self.ids)


def read_prompts(args: argparse.Namespace, problems: list[str]) -> PromptBatch:
    """The prompts of ``args`` (``--prompt``, ``--prompt-ids`` or ``--prompt-file``); each problem
    found is added to ``problems`` (all of them, not the first)."""
    batch = PromptBatch()
    given = [name for name, value in (("--prompt", args.prompt), ("--prompt-ids", args.prompt_ids),
                                      ("--prompt-file", args.prompt_file)) if value]
    if len(given) != 1:
        problems.append("give one of --prompt TEXT, --prompt-ids 1,2,3 or --prompt-file FILE.jsonl"
                        + (f" (got {' and '.join(given)})" if given else ""))
        return batch
    if args.prompt:
        n = len(args.prompt)
        batch.texts, batch.overrides, batch.lines = list(args.prompt), [None] * n, [None] * n
    elif args.prompt_ids:
        for text in args.prompt_ids:
            try:
                batch.ids.append([int(t) for t in text.split(",") if t.strip()])
            except ValueError:
                problems.append(f"--prompt-ids: expected comma-separated integers, got {text!r}")
        batch.overrides, batch.lines = [None] * len(batch.ids), [None] * len(batch.ids)
    else:
        _read_file(args.prompt_file, batch, problems)
    if args.chat and batch.ids:
        problems.append("--chat needs text prompts, not token ids")
    images = getattr(args, "image", None) or []
    if images and args.prompt_file:
        problems.append("--image applies to --prompt or --prompt-ids, not to --prompt-file")
    problems += [f"--image {path}: no such file" for path in images if not os.path.isfile(path)]
    if batch.texts and batch.ids:
        problems.append(f"{args.prompt_file}: lines mix prompt and prompt_ids; give one kind for the whole file")
    return batch


def _read_file(path: str, batch: PromptBatch, problems: list[str]) -> None:
    batch.from_file = True
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        problems.append(f"--prompt-file: cannot read {path!r}: {err}")
        return
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            item = json.loads(line)
        except ValueError as err:
            problems.append(f"{where}: not JSON ({err})")
            continue
        if not isinstance(item, dict):
            problems.append(f"{where}: expected an object, got {type(item).__name__}")
            continue
        overrides = {k: v for k, v in item.items() if k not in ("prompt", "prompt_ids")}
        problems += [f"{where}: {p}" for p in sampling_problems(overrides)]
        if ("prompt" in item) == ("prompt_ids" in item):
            problems.append(f"{where}: give exactly one of prompt and prompt_ids")
            continue
        if "prompt" in item:
            if not isinstance(item["prompt"], str):
                problems.append(f"{where}: prompt must be a string, got {item['prompt']!r:.60}")
                continue
            batch.texts.append(item["prompt"])
        else:
            ids = item["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                problems.append(f"{where}: prompt_ids must be a list of integers, got {ids!r:.60}")
                continue
            batch.ids.append(ids)
        batch.overrides.append(overrides or None)
        batch.lines.append(n)
    if not len(batch) and not problems:
        problems.append(f"--prompt-file: {path!r} holds no request")


def config_problems(config, batch: PromptBatch, args: argparse.Namespace, *, max_new_tokens: int,
                    max_model_len: int | None, stages: int = 1, partition: str | None = None,
                    encoded: list[list[int]] | None = None) -> list[str]:
    """What the model's config rules out: ids outside its vocabulary, a length beyond its rotary
    table, more tokens asked than the context leaves, a layout it cannot take. ``encoded``: the
    text prompts' ids (:func:`encode_texts`), checked as given ids are."""
    problems = []
    if getattr(args, "image", None) and config.vision_config is None:
        problems.append(f"--image: the model is text-only ({config.architecture}, no vision tower)")
    length = config.max_position_embeddings if max_model_len is None else max_model_len
    if max_model_len is not None and max_model_len > config.max_position_embeddings:
        problems.append(f"--max-model-len {max_model_len} is above the model's max_position_embeddings "
                        f"({config.max_position_embeddings})")
    overrides = batch.overrides or [None] * len(batch)
    no_room = set()
    for i, extra in enumerate(overrides):
        new = (extra or {}).get("max_new_tokens", max_new_tokens)
        if isinstance(new, int) and new >= length:
            no_room.add(new)
        prompts = batch.ids or encoded or []  # (a file holds ids or texts, not both)
        if i < len(prompts):
            ids = prompts[i]
            where = f"prompt {i}" if batch.lines[i] is None else f"{args.prompt_file}:{batch.lines[i]}"
            bad = [t for t in ids if not 0 <= t < config.vocab_size]
            if not ids:
                problems.append(f"{where}: the prompt is empty")
            if bad:
                problems.append(f"{where}: token ids must be in [0, vocab_size={config.vocab_size}), got {bad[:8]}")
            if isinstance(new, int) and new < length and ids and len(ids) + new > length:
                problems.append(f"{where}: {len(ids)} prompt tokens + max_new_tokens {new} exceed the model length "
                                f"{length} (lower max_new_tokens, or raise --max-model-len)")
    for new in sorted(no_room):
        problems.append(f"max_new_tokens {new} leaves no room for a prompt in the model length {length}")
    if stages > config.num_layers:
        problems.append(f"--stages {stages}: the model has {config.num_layers} layers")
    elif stages > 1 and partition is not None:
        from stagewise.parallel.plan import PARTITION_POLICIES, partition_layers

        if partition not in (*PARTITION_POLICIES, "measured"):
            try:
                partition_layers(config.num_layers, stages, partition)
            except ValueError as err:
                problems.append(f"--partition {partition!r}: {err}")
    return problems


def encode_texts(checkpoint, batch: PromptBatch, args: argparse.Namespace) -> list[list[int]] | None:
    """The text prompts' ids as the pipeline will encode them (the checkpoint's tokenizer, inside
    its chat template with ``--chat``), so that an empty or too long prompt is named before the
    model loads; None for id prompts, prompts with images (whose tokens the images add) or a
    checkpoint without a tokenizer (the pipeline names that)."""
    if not batch.texts or getattr(args, "image", None):
        return None
    from stagewise.frontend.prompts import encode_prompts, render_chat

    try:
        tokenizer = checkpoint.tokenizer()
    except (ValueError, OSError, KeyError):
        return None
    if tokenizer is None:
        return None
    return encode_prompts(tokenizer, batch.texts, None, chat=bool(getattr(args, "chat", False)),
                          render=lambda messages: render_chat(checkpoint, tokenizer, messages))


def report(prog: str, problems: list[str]) -> int:
    """Print every problem; the exit status of a usage error."""
    if len(problems) == 1:
        print(f"{prog}: {problems[0]}", file=sys.stderr)
    else:
        print(f"{prog}: {len(problems)} problems:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
    return 2

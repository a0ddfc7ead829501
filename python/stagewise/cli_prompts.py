"""What ``stagewise generate`` and ``stagewise launch`` share: the prompt and sampling arguments,
the prompt file, the checks made before anything loads, and how results are printed.

Checks name every problem at once. Those that need no model run first, before torch is imported;
those that need the model read its config only (:func:`config_problems`).

A prompt file (``--prompt-file FILE.jsonl``) holds one request per line: ``{"prompt": "..."}`` or
``{"prompt_ids": [1, 2, 3]}``, with any sampling field of the command line beside it
(``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
``presence_penalty``, ``frequency_penalty``, ``seed``, ``stop``, ``stop_token_ids``,
``ignore_eos``, ``logprobs``) that replaces the command line's for that line. The output is one
JSON line per request, in input order: ``index`` (0-based among the requests), ``line`` (its line
in the file), ``text``, ``token_ids``, ``finish_reason`` and, where they apply, ``error`` and
``logprobs``. Blank lines are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from stagewise.engine.params import SamplingParams

SAMPLING_DEFAULTS = {"max_new_tokens": 64, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                     "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": None,
                     "stop": [], "ignore_eos": False, "logprobs": None}
"""The command line's own defaults (a run plan's ``sampling`` section comes between them and the
options given)."""
SAMPLING_ARGS = tuple(SAMPLING_DEFAULTS)
LINE_FIELDS = (*SAMPLING_ARGS, "stop_token_ids")


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
    s = parser.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="most tokens to generate (default 64); more than the model's length leaves is an error")
    s.add_argument("--temperature", type=float, default=None, metavar="T", help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=None, metavar="K", help="0 = off")
    s.add_argument("--top-p", type=float, default=None, metavar="P", help="1 = off")
    s.add_argument("--min-p", type=float, default=None, metavar="P",
                   help="drop tokens less likely than P times the most likely one (0 = off)")
    s.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="divide (multiply) the positive (negative) logits of prompt and output tokens by R "
                        "(1 = off)")
    s.add_argument("--presence-penalty", type=float, default=None, metavar="X",
                   help="subtract X from the logits of tokens the output holds (-2 .. 2; 0 = off)")
    s.add_argument("--frequency-penalty", type=float, default=None, metavar="X",
                   help="subtract X per occurrence in the output (-2 .. 2; 0 = off)")
    s.add_argument("--seed", type=int, default=None, metavar="S", help="prompt i samples from seed + i")
    s.add_argument("--stop", action="append", default=None, metavar="S", help="a stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", default=None,
                   help="generate past the model's end-of-sequence tokens")
    s.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json or --prompt-file: each token's log-probability and the K most likely "
                        "(0 .. 20)")
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


class Requests:
    """The prompts of a command: text or ids, each with its sampling overrides (prompt file)."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.ids: list[list[int]] = []
        self.overrides: list[dict[str, Any] | None] = []
        self.lines: list[int | None] = []
        self.from_file = False

    def __len__(self) -> int:
        return len(self.texts) + len(self.ids)


def read_requests(args: argparse.Namespace, problems: list[str]) -> Requests:
    """The prompts of ``args`` (``--prompt``, ``--prompt-ids`` or ``--prompt-file``); each problem
    found is added to ``problems`` (all of them, not the first)."""
    req = Requests()
    given = [name for name, value in (("--prompt", args.prompt), ("--prompt-ids", args.prompt_ids),
                                      ("--prompt-file", args.prompt_file)) if value]
    if len(given) != 1:
        problems.append("give one of --prompt TEXT, --prompt-ids 1,2,3 or --prompt-file FILE.jsonl"
                        + (f" (got {' and '.join(given)})" if given else ""))
        return req
    if args.prompt:
        req.texts, req.overrides, req.lines = list(args.prompt), [None] * len(args.prompt), [None] * len(args.prompt)
    elif args.prompt_ids:
        for text in args.prompt_ids:
            try:
                req.ids.append([int(t) for t in text.split(",") if t.strip()])
            except ValueError:
                problems.append(f"--prompt-ids: expected comma-separated integers, got {text!r}")
        req.overrides, req.lines = [None] * len(req.ids), [None] * len(req.ids)
    else:
        _read_file(args.prompt_file, req, problems)
    if args.chat and req.ids:
        problems.append("--chat needs text prompts, not token ids")
    images = getattr(args, "image", None) or []
    if images and args.prompt_file:
        problems.append("--image applies to --prompt or --prompt-ids, not to --prompt-file")
    problems += [f"--image {path}: no such file" for path in images if not os.path.isfile(path)]
    if req.texts and req.ids:
        problems.append(f"{args.prompt_file}: lines mix prompt and prompt_ids; give one kind for the whole file")
    return req


def _read_file(path: str, req: Requests, problems: list[str]) -> None:
    req.from_file = True
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
        unknown = sorted(set(item) - {"prompt", "prompt_ids", *LINE_FIELDS})
        if unknown:
            problems.append(f"{where}: unknown fields {unknown}; expected prompt or prompt_ids and some of "
                            f"{list(LINE_FIELDS)}")
        if ("prompt" in item) == ("prompt_ids" in item):
            problems.append(f"{where}: give exactly one of prompt and prompt_ids")
            continue
        overrides = {k: v for k, v in item.items() if k in LINE_FIELDS}
        problems += [f"{where}: {p}" for p in sampling_problems(overrides)]
        if "prompt" in item:
            if not isinstance(item["prompt"], str):
                problems.append(f"{where}: prompt must be a string, got {item['prompt']!r:.60}")
                continue
            req.texts.append(item["prompt"])
        else:
            ids = item["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                problems.append(f"{where}: prompt_ids must be a list of integers, got {ids!r:.60}")
                continue
            req.ids.append(ids)
        req.overrides.append(overrides or None)
        req.lines.append(n)
    if not len(req) and not problems:
        problems.append(f"--prompt-file: {path!r} holds no request")


def sampling_args(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling values of a command: the options given, else ``defaults`` (a run plan's
    ``sampling``), else :data:`SAMPLING_DEFAULTS`."""
    out = dict(SAMPLING_DEFAULTS)
    out.update(defaults or {})
    out.update({name: getattr(args, name) for name in SAMPLING_ARGS if getattr(args, name) is not None})
    return out


def sampling_problems(fields: dict[str, Any]) -> list[str]:
    """Every sampling value that is wrong, each checked on its own (so that all are named)."""
    problems = []
    for name, value in fields.items():
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as err:
            problems.append(str(err).replace("SamplingParams.", ""))
    return problems


def config_problems(config, req: Requests, args: argparse.Namespace, *, sampling: dict[str, Any],
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
    overrides = req.overrides or [None] * len(req)
    no_room = set()
    for i, extra in enumerate(overrides):
        new = (extra or {}).get("max_new_tokens", sampling["max_new_tokens"])
        if isinstance(new, int) and new >= length:
            no_room.add(new)
        prompts = req.ids or encoded or []  # (a file holds ids or texts, not both)
        if i < len(prompts):
            ids = prompts[i]
            where = f"prompt {i}" if req.lines[i] is None else f"{args.prompt_file}:{req.lines[i]}"
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


def encode_texts(checkpoint, req: Requests, args: argparse.Namespace) -> list[list[int]] | None:
    """The text prompts' ids as the pipeline will encode them (the checkpoint's tokenizer, inside
    its chat template with ``--chat``), so that an empty or too long prompt is named before the
    model loads; None for id prompts, prompts with images (whose tokens the images add) or a
    checkpoint without a tokenizer (the pipeline names that)."""
    if not req.texts or getattr(args, "image", None):
        return None
    from stagewise.prompts import encode_prompts, render_chat

    try:
        tokenizer = checkpoint.tokenizer()
    except (ValueError, OSError, KeyError):
        return None
    if tokenizer is None:
        return None
    return encode_prompts(tokenizer, req.texts, None, chat=bool(getattr(args, "chat", False)),
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


def completion_json(c, *, index: int | None = None, line: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {} if index is None else {"index": index}
    if line is not None:
        out["line"] = line
    out.update(text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason)
    if c.error:
        out["error"] = c.error
    if c.logprobs is not None:
        out["logprobs"] = [{"token": e.token, "logprob": e.logprob, "top": [[t, v] for t, v in e.top]}
                           if e is not None else None for e in c.logprobs]
    return out

"""``stagewise generate``: load a model (in this process, or as pipeline stages) and generate for
one or more prompts.

Every argument is checked before anything loads, and every problem is named at once: first what
needs no model, then what the model's config rules out (reading the config only). Plain output
streams each prompt's text as it is generated; ``--json`` prints one object, ``--prompt-file`` one
JSON line per request (:mod:`stagewise.cli.output`).
"""

from __future__ import annotations

import argparse

from stagewise import startup_gc
from stagewise.cli.model_args import add_model_arguments, config_checks, model_problems, open_pipeline
from stagewise.cli.output import generate_and_print
from stagewise.cli.prompt_args import PromptBatch, add_prompt_arguments, read_prompts, report
from stagewise.cli.sampling import sampling_args
from stagewise.engine.params import SamplingParams, sampling_problems

PROG = "stagewise generate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="an HF folder, a .gguf file, or an embedded model name (smollm2-135m); "
                             "with --plan, the plan's model")
    add_prompt_arguments(parser)
    add_model_arguments(parser)


def argument_problems(args: argparse.Namespace) -> tuple[list[str], PromptBatch]:
    """Every problem of the arguments that needs no model."""
    problems: list[str] = []
    batch = read_prompts(args, problems)
    problems += sampling_problems(sampling_args(args))
    problems += model_problems(args)
    if args.logprobs is not None and not (args.json or args.prompt_file):
        problems.append("--logprobs needs --json or --prompt-file (the log-probabilities are printed as JSON)")
    if args.prompt_file and args.json:
        problems.append("--prompt-file prints JSON lines already; leave out --json")
    return problems, batch


def run(args: argparse.Namespace) -> int:
    # Two passes, each naming every problem it finds: what the arguments alone decide (at once,
    # before torch is even imported), then what the model's config decides (its config only).
    problems, batch = argument_problems(args)
    if problems:
        return report(PROG, problems)
    startup_gc.pause()  # until the model is loaded: see stagewise.startup_gc
    try:
        problems = config_checks(args, batch, SamplingParams(**sampling_args(args)).max_new_tokens)
        if problems:
            return report(PROG, problems)
        pipe = open_pipeline(args, PROG)
    finally:
        startup_gc.settle()
    if pipe is None:
        return 1
    return generate_and_print(pipe, args, batch, prog=PROG)

"""The `stagewise` command line: one module per command, listed in :data:`COMMANDS`.

A command's module has ``add_arguments(parser)`` and ``run(args) -> int``; a command that parses
its own arguments (``plan``, ``bench``: their parsers import what they need) has ``run(argv) ->
int`` alone and gets the arguments after its name. Argument problems are found before torch is
imported: the command modules import nothing heavy at their top.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import dataclass
from types import ModuleType

from stagewise.cli import bench, demo, doctor, generate, launch, plan, serve, stage
from stagewise.cli.prompt_args import negative_ids_fix


@dataclass(frozen=True)
class Command:
    name: str
    module: ModuleType
    help: str
    own_parser: bool = False
    """It parses its own arguments: its ``run`` takes the argument list after its name."""


COMMANDS = (
    Command("generate", generate, "generate text with a model in this process, or as pipeline stages"),
    Command("serve", serve, "an OpenAI-compatible HTTP server in front of the model"),
    Command("stage", stage, "run one pipeline stage of a run plan (a process)"),
    Command("launch", launch, "start a run plan's stages on their hosts (printed commands, ssh, Ray) and drive them"),
    Command("doctor", doctor, "check a multi-host run plan in seconds, before any weight loads: hosts, versions, "
            "the model, every hop"),
    Command("plan", plan, "memory and latency of TP/PP/DP/EP layouts (plan MODEL ..., plan memory, plan ranks, "
            "plan validate; plan --help)", own_parser=True),
    Command("bench", bench, "microbenchmarks against their baselines (bench --help)", own_parser=True),
    Command("demo", demo, "SmolLM2-135M as a 3-stage pipeline on this machine: a question, the answer streamed, "
            "each stage's share"),
)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line's parser, and each command's."""
    from stagewise import __version__

    top = argparse.ArgumentParser(prog="stagewise", description="one model across processes and machines")
    top.add_argument("--version", action="version", version=f"stagewise {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers = {}
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help,
                           add_help=not command.own_parser)
        if not command.own_parser:
            command.module.add_arguments(p)
        p.set_defaults(run=command.module.run, own_parser=command.own_parser)
        parsers[command.name] = p
    return top, parsers


def main(argv: list[str] | None = None) -> int:
    top, parsers = build_parser()
    args, extra = top.parse_known_args(negative_ids_fix(sys.argv[1:] if argv is None else list(argv)))
    if args.own_parser:
        return args.run(extra)
    if extra:  # named by the command's own parser, with its usage and the option meant
        parsers[args.command].error(unrecognized(parsers[args.command], extra))
    return args.run(args)


def unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """The error for arguments ``parser`` does not take, each misspelled option with the closest
    one it has."""
    options = [o for action in parser._actions for o in action.option_strings]
    hints = []
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name.startswith("-"):
            close = difflib.get_close_matches(name, options, n=1, cutoff=0.7)
            if close:
                hints.append(f"{name}: did you mean {close[0]}?")
    return f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else "")


def _main() -> int:
    """The console entry point: Ctrl-C ends cleanly (stage processes are stopped on the way out)."""
    try:
        return main()
    except KeyboardInterrupt:
        print("stagewise: interrupted", file=sys.stderr)
        return 130

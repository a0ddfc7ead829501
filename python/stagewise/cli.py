"""The `stagewise` command line."""

from __future__ import annotations

import argparse
import difflib
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["plan", "validate"]:  # runs the pipeline: the benchmarks' side of the planner
        from stagewise.bench.plan_validate import main as validate_main

        return validate_main(argv[2:])
    if argv and argv[0] == "plan":  # its own parser: `plan MODEL ...`, `plan memory ...`, options first
        from stagewise.planner.cli import main as plan_main

        return plan_main(argv[1:])
    if argv and argv[0] == "bench":  # its own parser, built only here: the benchmarks import torch
        from stagewise.bench import add_arguments, run

        bench = argparse.ArgumentParser(prog="stagewise bench", description="microbenchmarks against their baselines")
        add_arguments(bench)
        return run(bench.parse_args(argv[1:]))
    parser = argparse.ArgumentParser(prog="stagewise", description=__doc__)
    from stagewise import __version__

    parser.add_argument("--version", action="version", version=f"stagewise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", add_help=False, help="microbenchmarks against their baselines (bench --help)")
    from stagewise import cli_generate

    parsers = {"generate": sub.add_parser("generate", help="generate text with a model in this process")}
    cli_generate.add_arguments(parsers["generate"])
    from stagewise import cli_serve

    parsers["serve"] = sub.add_parser("serve", help="an OpenAI-compatible HTTP server in front of the model")
    cli_serve.add_arguments(parsers["serve"])
    from stagewise import cli_stage

    parsers["stage"] = sub.add_parser("stage", help="run one pipeline stage of a run plan (a process)")
    cli_stage.add_arguments(parsers["stage"])
    plan = sub.add_parser("plan", add_help=False, help="memory and latency of TP/PP/DP/EP layouts "
                          "(plan MODEL ..., plan memory, plan ranks, plan validate; plan --help)")
    plan.add_argument("plan_args", nargs=argparse.REMAINDER)
    from stagewise import cli_launch

    parsers["launch"] = sub.add_parser("launch", help="start a run plan's stages on their hosts (printed "
                                       "commands, ssh) and drive them")
    cli_launch.add_arguments(parsers["launch"])
    from stagewise import cli_doctor

    parsers["doctor"] = sub.add_parser("doctor", help="check a multi-host run plan in seconds, before any weight "
                                       "loads: hosts, versions, the model, every hop")
    cli_doctor.add_arguments(parsers["doctor"])
    from stagewise.cli_prompts import negative_ids_fix

    args, extra = parser.parse_known_args(negative_ids_fix(argv))
    if extra:  # named by the command's own parser, with its usage and the option meant
        parsers[args.command].error(unrecognized(parsers[args.command], extra))
    if args.command == "generate":
        return cli_generate.run(args)
    if args.command == "serve":
        return cli_serve.run(args)
    if args.command == "stage":
        return cli_stage.main(args)
    if args.command == "plan":
        from stagewise.planner.cli import main as plan_main

        return plan_main(args.plan_args)
    if args.command == "launch":
        return cli_launch.run(args)
    if args.command == "doctor":
        return cli_doctor.run(args)
    return 2


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


if __name__ == "__main__":
    sys.exit(_main())

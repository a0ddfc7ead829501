"""The `stagewise` command line."""

from __future__ import annotations

import argparse
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

    cli_generate.add_arguments(sub.add_parser("generate", help="generate text with a model in this process"))
    from stagewise import cli_serve

    cli_serve.add_arguments(sub.add_parser("serve", help="an OpenAI-compatible HTTP server in front of the model"))
    from stagewise import cli_stage

    cli_stage.add_arguments(sub.add_parser("stage", help="run one pipeline stage of a run plan (a process)"))
    plan = sub.add_parser("plan", add_help=False, help="memory and latency of TP/PP/DP/EP layouts "
                          "(plan MODEL ..., plan memory, plan ranks, plan validate; plan --help)")
    plan.add_argument("plan_args", nargs=argparse.REMAINDER)
    from stagewise import cli_launch

    cli_launch.add_arguments(sub.add_parser("launch", help="start a run plan's stages on their hosts (printed "
                                            "commands, ssh) and drive them"))
    from stagewise import cli_doctor

    cli_doctor.add_arguments(sub.add_parser("doctor", help="check a multi-host run plan in seconds, before any weight "
                                            "loads: hosts, versions, the model, every hop"))
    from stagewise.cli_prompts import negative_ids_fix

    args = parser.parse_args(negative_ids_fix(argv))
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


def _main() -> int:
    """The console entry point: Ctrl-C ends cleanly (stage processes are stopped on the way out)."""
    try:
        return main()
    except KeyboardInterrupt:
        print("stagewise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(_main())

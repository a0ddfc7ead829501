"""The command table: every command listed is a module of `stagewise.cli` and a subcommand of the
parser; a command with its own parser gets every argument after its name, untouched; `plan
validate` reaches the benchmarks' plan validation and the rest of `plan` the planner; building the
parser imports no torch; `make demo` runs the demo command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stagewise import cli

ROOT = Path(__file__).resolve().parents[2]


def test_every_command_is_a_module_and_a_subcommand():
    top, parsers = cli.build_parser()
    names = [c.name for c in cli.COMMANDS]
    assert names == list(parsers) and len(set(names)) == len(names)
    assert sorted(names) == sorted(p.stem for p in (ROOT / "python/stagewise/cli").glob("*.py")
                                   if p.stem in names), "a command without its module"
    for command in cli.COMMANDS:
        assert command.module.__name__ == f"stagewise.cli.{command.name}"
        assert hasattr(command.module, "run")
        assert command.own_parser != hasattr(command.module, "add_arguments"), command.name
    assert all(name in top.format_help() for name in names)


@pytest.mark.parametrize("argv", [
    ["plan", "memory", "qwen3-4b", "--stages", "2", "4", "--json"],
    ["plan", "--help"],
    ["plan", "-x", "--", "7"],
    ["bench", "e2e", "--stages", "1,2", "--tiny"],
])
def test_a_command_with_its_own_parser_gets_its_arguments_untouched(argv, monkeypatch):
    seen = []
    command = next(c for c in cli.COMMANDS if c.name == argv[0])
    monkeypatch.setattr(command.module, "run", lambda rest: seen.append(rest) or 5)
    assert cli.main(argv) == 5
    assert seen == [argv[1:]]


def test_plan_validate_is_the_benchmarks_and_the_rest_the_planners(monkeypatch):
    import stagewise.bench.plan_validate as validate
    import stagewise.planner.cli as planner

    calls = []
    monkeypatch.setattr(validate, "main", lambda argv: calls.append(("validate", argv)) or 0)
    monkeypatch.setattr(planner, "main", lambda argv: calls.append(("planner", argv)) or 0)
    assert cli.main(["plan", "validate", "smollm2-135m", "--stages", "1", "2"]) == 0
    assert cli.main(["plan", "ranks", "--world-size", "4"]) == 0
    assert calls == [("validate", ["smollm2-135m", "--stages", "1", "2"]), ("planner", ["ranks", "--world-size", "4"])]


def test_the_parser_imports_no_torch():
    code = ("import sys; from stagewise.cli import build_parser; build_parser(); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_make_demo_runs_the_demo_command():
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "stagewise demo" in recipe, recipe
    args = cli.build_parser()[0].parse_args(["demo"])
    assert args.run is cli.demo.run and args.stages == 3 and args.partition == "balanced"

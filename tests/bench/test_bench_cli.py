"""`stagewise bench`: a subcommand per suite, each with its own options and help, every suite
listed once (stagewise.bench.cli.SUITES); the shared options; and the command line imports the
benchmarks only for `stagewise bench` and `stagewise plan validate`."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from stagewise.bench.cli import SUITES, main, parser

OWN = {"kernels": "--ops", "e2e": "--prompt-len", "shm": "--spin-us", "serve": "--rates", "structured": "--tokens"}
"""An option only that suite has (transport and profile have none that no other has)."""


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_the_top_help_lists_the_suites_and_none_of_their_options(capsys):
    text = _help(["--help"], capsys)
    for name, (_, what) in SUITES.items():
        assert name in text and what.split()[0] in text
    assert not any(option in text for option in (*OWN.values(), "--tiny", "--out"))


@pytest.mark.parametrize("suite", list(SUITES))
def test_each_suite_has_its_own_options_and_the_shared_ones(suite, capsys):
    text = _help([suite, "--help"], capsys)
    assert text.startswith(f"usage: stagewise bench {suite} ")
    for shared in ("--tiny", "--threads", "--out"):
        assert shared in text
    for other, option in OWN.items():
        assert (option in text) == (other == suite), option


def test_an_option_of_another_suite_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["kernels", "--rates", "4"])
    assert exit_.value.code == 2 and "unrecognized arguments: --rates 4" in capsys.readouterr().err


@pytest.mark.parametrize("suite", list(SUITES))
def test_a_suite_is_a_module_with_its_options_and_its_run(suite):
    module = importlib.import_module(SUITES[suite][0])
    assert callable(module.add_arguments) and callable(module.run)


def test_every_suite_is_a_subcommand():
    sub = next(a for a in parser()._actions if a.dest == "suite")
    assert list(sub.choices) == list(SUITES)


def _imports_bench(argv: list[str]) -> bool:
    code = (f"import sys\nfrom stagewise.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "sys.exit(3 if any(m.startswith('stagewise.bench') for m in sys.modules) else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 3), done.stderr
    return done.returncode == 3


def test_only_bench_and_plan_validate_import_the_benchmarks():
    assert not _imports_bench(["--help"])
    assert not _imports_bench(["generate", "--help"])
    assert not _imports_bench(["plan", "--help"])
    assert _imports_bench(["bench", "--help"])
    assert _imports_bench(["plan", "validate", "--help"])


def test_plan_validate_keeps_its_path():
    from stagewise.bench.plan_validate import main as validate

    with pytest.raises(SystemExit) as exit_:
        validate(["--help"])
    assert exit_.value.code == 0

"""STAGEWISE_BENCH_TINY=1 (the documentation's examples run with it) is --tiny and nothing else:
toy sizes for every suite and for `plan validate`, which then leaves the planner's validation
record alone; and `--transports` names what the transport suite measures."""

from __future__ import annotations

import argparse
import json

import pytest

from stagewise.bench import e2e, options, plan_validate
from stagewise.bench.cli import main as bench_main
from stagewise.bench.plan_validate import runs
from stagewise.bench.transport.channels import TRANSPORTS as SUITE_TRANSPORTS
from stagewise.planner import validate
from stagewise.planner.validate import MeasuredRun
from stagewise.transport.registry import TRANSPORTS


def test_the_environment_variable_runs_a_suite_as_tiny(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(options.TINY_ENV, "1")
    assert bench_main(["kernels", "--ops", "rms_norm", "--no-compile", "--device", "cpu", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-kernels.json")
    assert json.loads(path.read_text())["machine"]["preset"] == "tiny"
    assert "STAGEWISE_BENCH_TINY=1: toy sizes" in capsys.readouterr().err


def test_a_bad_value_is_refused(monkeypatch, capsys):
    monkeypatch.setenv(options.TINY_ENV, "yes")
    assert bench_main(["kernels", "--ops", "rms_norm"]) == 2
    assert "STAGEWISE_BENCH_TINY must be 1 (toy sizes) or 0, got 'yes'" in capsys.readouterr().err


def test_e2e_sizes_not_given_are_toy_ones_with_tiny_and_given_ones_stay():
    def sizes(tiny: bool, **given) -> dict:
        args = argparse.Namespace(tiny=tiny, batch_sizes=None, prompt_len=None, new_tokens=None, repeats=None)
        vars(args).update(given)
        e2e.resolve_sizes(args)
        return {k: getattr(args, k) for k in e2e.SIZES}

    assert sizes(False) == {"batch_sizes": "1,16", "prompt_len": 128, "new_tokens": 64, "repeats": 3}
    assert sizes(True) == {"batch_sizes": "1", "prompt_len": 8, "new_tokens": 4, "repeats": 1}
    assert sizes(True, prompt_len=32)["prompt_len"] == 32


def test_transports_help_names_what_the_suite_measures(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no line break inside a name such as tcp-tls
    parser = argparse.ArgumentParser()
    from stagewise.bench import transport

    transport.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert f"comma-separated subset of {','.join(SUITE_TRANSPORTS)} (default: all" in text
    assert "shm" in SUITE_TRANSPORTS and "cuda-ipc" in SUITE_TRANSPORTS
    assert {m.removesuffix("-tls") for m in SUITE_TRANSPORTS} <= set(TRANSPORTS)  # tcp-tls: tcp in TLS


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A small random checkpoint: the measurement is faked, only the config and weights' types are read."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("llama") / "m"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64)).save_pretrained(path)
    return path


@pytest.mark.parametrize("tiny", [False, True])
def test_plan_validate_with_tiny_leaves_the_validation_record_alone(tmp_path, monkeypatch, tiny, tiny_llama):
    store = tmp_path / "validation.json"
    monkeypatch.setattr(validate, "STORE", store)
    seen = {}

    def fake_measure(model, stages, *, batch, input_length, output_length, transport=None, repeats=3, log=print):
        seen.update(input_length=input_length, output_length=output_length, repeats=repeats)
        return MeasuredRun(stages=stages, per_stage_busy_s=[0.01] * stages, tpot_s=0.01, ttft_s=0.1, bubble_s=0.0)

    monkeypatch.setattr(runs, "measure", fake_measure)
    if tiny:
        monkeypatch.setenv(options.TINY_ENV, "1")
    else:
        monkeypatch.delenv(options.TINY_ENV, raising=False)
    argv = [str(tiny_llama), "--stages", "1", "--device-profile", "cpu-generic", "--out", str(tmp_path / "out")]
    assert plan_validate.main(argv) == 0
    assert seen == ({"input_length": 16, "output_length": 4, "repeats": 1} if tiny else
                    {"input_length": 128, "output_length": 32, "repeats": 3})
    assert store.exists() is not tiny
    assert list((tmp_path / "out").glob("*-plan-validate.json"))  # the results are written either way

"""The planner's confidence per prediction: the error band only where the latest validation covers
the case (the errors measured there), "not validated" and why everywhere else; in the validation
record, in the text table and in the JSON."""

from __future__ import annotations

import json
import re

import pytest

from stagewise.cli import main as stagewise_main
from stagewise.model.config import ModelConfig
from stagewise.parallel.ranks import ParallelConfig
from stagewise.planner import validate
from stagewise.planner.estimate import Workload, estimate_layout
from stagewise.planner.profiles import load_profile
from stagewise.planner.validate import MeasuredRun, compare, load_latest, summary

CONFIG = ModelConfig(architecture="qwen3", vocab_size=1000, hidden_size=64, num_layers=8, num_heads=8,
                     num_kv_heads=4, head_dim=8, intermediate_size=128, qk_norm=True)
INPUT, OUTPUT = 16, 4


def _rows(stages: int, batch: int, tpot_factor: float, ttft_factor: float) -> list[dict]:
    """A validation run whose measurements are the prediction scaled: errors known by hand."""
    est = estimate_layout(CONFIG, ParallelConfig(world_size=stages, pp=stages),
                          Workload(input_length=INPUT, output_length=OUTPUT, batch=batch), load_profile("cpu-generic"))
    m = est.decode.pipeline.num_microbatches
    measured = MeasuredRun(stages=stages, per_stage_busy_s=[t * m * tpot_factor for t in
                                                             est.decode.pipeline.stage_compute_times_s],
                           tpot_s=est.tpot_s * tpot_factor, ttft_s=est.ttft_s * ttft_factor,
                           bubble_s=est.decode_bubble_s)
    return [{"batch": batch, **r} for r in compare(est, measured)]


@pytest.fixture
def record(tmp_path, monkeypatch):
    """A record of runs at PP 1 and 2, batch 1 and 4, stored where `stagewise plan` reads it."""
    rows = (_rows(1, 1, 1.25, 1.0) + _rows(2, 1, 1.0, 0.5) + _rows(1, 4, 1.0, 1.0) + _rows(2, 4, 1.0, 1.0))
    data = summary(rows, model="tiny-qwen3", architecture="qwen3", profile={"name": "cpu-generic", "kind": "cpu"},
                   workload={"batch": [1, 4], "input_length": INPUT, "output_length": OUTPUT, "dtype": "bfloat16",
                             "weight_quant": "", "embed_quant": ""},
                   machine={"date_utc": "2026-11-21T00:00:00Z"})
    path = tmp_path / "validation.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(validate, "STORE", path)
    return load_latest(path)


def _case(v, **kw):
    args = dict(tp=1, pp=1, batch=1, input_length=INPUT, output_length=OUTPUT, architecture="qwen3",
                profile_name="cpu-generic", profile_kind="cpu", weight_dtype="bfloat16")
    args.update(kw)
    return v.confidence(**args)


def test_a_measured_case_carries_the_errors_measured_there(record):
    c = _case(record)  # PP 1, batch 1: TPOT measured 1.25x the prediction
    assert c.validated and c.not_validated_because == ()
    assert c.error_pct["tpot"] == pytest.approx(20.0) and c.error_pct["ttft"] == pytest.approx(0.0)
    assert c.label() == "TTFT ±0.0%, TPOT ±20%" and c.error_from == "its runs at PP=1, batch 1"
    c = _case(record, pp=2)  # TTFT measured at half the prediction: +100 %
    assert c.error_pct["ttft"] == pytest.approx(100.0) and c.error_pct["tpot"] == pytest.approx(0.0)


def test_a_case_inside_the_range_but_not_run_carries_the_ranges_largest_errors(record):
    c = _case(record, batch=2)
    assert c.validated and c.error_pct == record.expected_error_pct
    assert c.error_pct["tpot"] == pytest.approx(20.0) and c.error_pct["ttft"] == pytest.approx(100.0)
    assert c.error_from == "over its whole range: this case was not run"


def test_outside_the_range_it_says_not_validated_and_why(record):
    c = _case(record, tp=2, pp=4, batch=8, input_length=2048, output_length=512, architecture="llama",
              profile_name="h100-sxm", profile_kind="gpu", weight_quant="q4_1", embed_quant="q8_0",
              weight_dtype="float32")
    assert not c.validated and c.error_pct is None and c.label() == "not validated"
    assert list(c.not_validated_because) == [
        "PP=4 outside validated 1..2", "TP=2 outside validated 1..1", "batch=8 outside validated 1..4",
        "input=2048 outside validated 16..16", "output=512 outside validated 4..4", "llama not validated (only qwen3)",
        "profile h100-sxm not validated (only cpu-generic, a cpu profile)",
        "q4_1 linears, q8_0 embedding, float32 compute not validated (only dense bfloat16 weights)"]
    assert c.to_dict() == {"validated": False, "expected_error_pct": None, "error_from": None,
                           "not_validated_because": list(c.not_validated_because)}


def test_the_record_line_states_its_range_without_claiming_it_for_every_case(record):
    line = record.describe()
    assert line.startswith("latest validation (2026-11-21T00:00:00Z) covers tiny-qwen3 (qwen3) on cpu-generic: ")
    assert "PP 1..2, TP 1, batch 1..4, input 16, output 4, dense bfloat16 weights" in line
    assert line.endswith("largest errors there: TTFT ±100%, TPOT ±20%")


def _table(out: str) -> list[str]:
    """The rows of the printed table (not the breakdown lines, which start '1. ')."""
    return [line for line in out.splitlines() if re.match(r"\d+ +TP=", line)]


def _plan(capsys, *argv):
    code = stagewise_main(["plan", *argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def test_the_table_gives_each_row_its_own_confidence(record, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 8,
                                  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
                                  "intermediate_size": 128, "torch_dtype": "bfloat16"}))
    argv = [str(config), "--num-devices", "4", "--tp-sizes", "1", "--pp-sizes", "1", "2", "4", "--device-profile",
            "cpu-generic", "--input-length", str(INPUT), "--output-length", str(OUTPUT)]
    out = _plan(capsys, *argv)
    by_pp = {int(line.split("PP=")[1].split()[0]): line for line in _table(out)}
    assert "TTFT ±0.0%, TPOT ±20%" in by_pp[1] and by_pp[1].rstrip().endswith("-")
    assert "TTFT ±100%, TPOT ±0.0%" in by_pp[2]
    assert "not validated" in by_pp[4] and "PP=4 outside validated 1..2" in by_pp[4]
    assert "Every layout below is not validated" not in out  # only one row is outside
    assert "expected error: the largest error the validation measured (its runs at PP=1, batch 1; " in out
    data = json.loads(_plan(capsys, *argv, "--json"))
    conf = {r["pp"]: r["confidence"] for r in data["layouts"]}
    assert conf[1]["validated"] and conf[1]["expected_error_pct"]["tpot"] == pytest.approx(20.0)
    assert not conf[4]["validated"] and conf[4]["not_validated_because"] == ["PP=4 outside validated 1..2"]
    assert data["validation"] == record.describe()


def test_reasons_every_row_shares_are_said_once_above_the_table(record, capsys):
    out = _plan(capsys, "qwen3-4b", "--num-devices", "4", "--tp-sizes", "1", "2", "--device-profile", "h200")
    lines = out.splitlines()
    shared = next(line for line in lines if line.startswith("Every layout below is not validated: "))
    assert "input=2048 outside validated 16..16" in shared and "profile h200 not validated" in shared
    assert "TP=2" not in shared  # only the TP=2 row has it: said on that row
    table = _table(out)
    assert len(table) == 2 and all("not validated" in line for line in table)
    assert any(line.endswith("as above") for line in table)
    assert any(line.endswith("TP=2 outside validated 1..1") for line in table)
    assert "±" not in "\n".join(table)


def test_without_a_record_no_row_claims_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(validate, "STORE", tmp_path / "missing.json")
    out = _plan(capsys, "qwen3-4b", "--num-devices", "1")
    assert "no validation on record" in out and "±" not in out

"""`stagewise plan validate --kv-cache-dtype int8`: every cell's pipeline gets the compact cache, the
prediction prices it and the results say which. The runs are faked:
tests/bench/test_plan_validate_ranks.py runs real cells."""

from __future__ import annotations

import json

import pytest

from stagewise.bench import plan_validate
from stagewise.bench.plan_validate import runs
from stagewise.planner import validate
from stagewise.planner.validate import MeasuredRun

MODEL = "smollm2-135m"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_every_cell_runs_and_is_priced_with_the_kv_cache_dtype(tmp_path, monkeypatch, capsys, kv_cache_dtype):
    monkeypatch.setattr(validate, "STORE", tmp_path / "validation.json")
    asked = []

    def fake_measure(model, stages, *, batch, input_length, output_length, transport=None, repeats=3, log=print,
                     kv_cache_dtype="auto"):
        asked.append(kv_cache_dtype)
        return MeasuredRun(stages=stages, per_stage_busy_s=[0.01] * stages, tpot_s=0.01, ttft_s=0.1, bubble_s=0.0)

    monkeypatch.setattr(runs, "measure", fake_measure)
    out = tmp_path / "out"
    argv = [MODEL, "--tiny", "--stages", "1", "2", "--device-profile", "cpu-generic", "--out", str(out),
            "--kv-cache-dtype", kv_cache_dtype]
    assert plan_validate.main(argv) == 0
    assert asked == [kv_cache_dtype] * 2
    (path,) = out.glob("*-plan-validate.json")
    data = json.loads(path.read_text())
    assert data["workload"]["kv_cache_dtype"] == kv_cache_dtype
    assert f"{kv_cache_dtype} KV cache, batch 1" in path.with_suffix(".md").read_text()
    # The record such a run would store covers predictions of its own cache only.
    record = validate.Validation(data)
    case = dict(tp=1, pp=1, batch=1, input_length=16, output_length=4, architecture="llama",
                profile_name="cpu-generic", profile_kind="cpu", weight_quant="q4_1", embed_quant="q8_0",
                weight_dtype="float32")
    assert record.confidence(**case, kv_cache_dtype=kv_cache_dtype).validated
    other = "int8" if kv_cache_dtype == "auto" else "auto"
    assert record.confidence(**case, kv_cache_dtype=other).not_validated_because == (
        f"KV cache {other} not validated (only {kv_cache_dtype})",)


def test_the_prediction_of_an_int8_cell_reads_fewer_cache_bytes(tmp_path, monkeypatch):
    """The same cell predicted for both caches: the int8 one's decode attention streams
    (D + 2) / (4 D) of float32's cache bytes (SmolLM2: 66 / 256)."""
    from stagewise.bench.plan_validate import compare

    monkeypatch.setattr(validate, "STORE", tmp_path / "validation.json")
    monkeypatch.setattr(runs, "measure", lambda *a, **kw: MeasuredRun(
        stages=1, per_stage_busy_s=[0.01], tpot_s=0.01, ttft_s=0.1, bubble_s=0.0))
    predicted = {}
    real = compare.estimate_layout

    def spy(config, layout, work, profile, **kw):
        est = real(config, layout, work, profile, **kw)
        predicted[work.kv_cache_dtype] = est
        return est

    monkeypatch.setattr(compare, "estimate_layout", spy)
    for kv_cache_dtype in ("auto", "int8"):
        argv = [MODEL, "--tiny", "--device-profile", "cpu-generic", "--out", str(tmp_path / kv_cache_dtype),
                "--input-length", "64", "--kv-cache-dtype", kv_cache_dtype]
        assert plan_validate.main(argv) == 0
    assert predicted["int8"].kv_bytes_per_rank / predicted["auto"].kv_bytes_per_rank == 66 / 256

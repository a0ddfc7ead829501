"""`stagewise plan validate --partition measured`: a measured split's prediction against the run it
gives, end to end on SmolLM2 (real probes with a cache of their own, stages on 2 and 1 threads);
the options it refuses; the planner's validation record left alone."""

from __future__ import annotations

import json

import pytest

from stagewise.bench import plan_validate
from stagewise.bench.plan_validate.split import stage_threads
from stagewise.planner import validate

MODEL = "smollm2-135m"


def test_stage_threads_are_dealt_in_turn_and_bad_ones_named():
    assert stage_threads(None, 3, 2) == [2, 2, 2]
    assert stage_threads("2,1", 3, 1) == [2, 1, 2]
    for bad in ("", "0,1", "two", "2,,1"):
        with pytest.raises(ValueError, match="--stage-threads: expected threads >= 1"):
            stage_threads(bad, 2, 1)


def test_a_measured_split_is_run_and_compared_with_its_prediction(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = tmp_path / "validation.json"
    monkeypatch.setattr(validate, "STORE", store)
    out = tmp_path / "out"
    argv = [MODEL, "--tiny", "--partition", "measured", "--stages", "2", "--stage-threads", "2,1",
            "--output-length", "6", "--out", str(out)]
    assert plan_validate.main(argv) == 0
    err = capsys.readouterr().err
    [path] = out.glob("*-plan-validate-measured.json")
    data = json.loads(path.read_text())
    rows = {r["metric"]: r for r in data["rows"]}
    assert sorted(rows) == ["stage0_busy", "stage1_busy", "tpot"]
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 and r["error_pct"] is not None for r in rows.values())
    # The prediction is the split's: its TPOT the sum of the stages' step times (hops not counted) ...
    assert rows["tpot"]["predicted_s"] == pytest.approx(rows["stage0_busy"]["predicted_s"]
                                                        + rows["stage1_busy"]["predicted_s"])
    # ... and the run took the split the driver said, each stage at its threads.
    ranges = rows["tpot"]["ranges"]
    a, b = ranges.split(", ")[0].split("-")
    assert f"stage 0: layers {a}-{b}" in err and rows["tpot"]["threads"] == [2, 1]
    assert "predicted TPOT at batch 1" in err
    assert not store.exists()  # the profile-based validation record is not this one
    assert (out / path.name.replace(".json", ".md")).read_text().count("| 1 | 2 |") == 3


@pytest.mark.parametrize(("extra", "message"), [
    (["--partition", "measured", "--batch", "4"], "--partition measured predicts batch 1"),
    (["--stage-threads", "2,1"], "--stage-threads applies to --partition measured"),
    (["--remeasure"], "--remeasure applies to --partition measured")])
def test_options_it_refuses(tmp_path, capsys, extra, message):
    assert plan_validate.main([MODEL, "--tiny", "--out", str(tmp_path), *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", [[], ["--remeasure"]])
def test_remeasure_reaches_the_split(tmp_path, monkeypatch, flag):
    """--remeasure asks the measured split to measure each node again (the split itself is tested
    with the launcher: tests/launch/test_measured.py)."""
    from stagewise.launch import measured

    asked = []

    class Stop(Exception):
        pass

    def split(*args, remeasure=False, **kw):
        asked.append(remeasure)
        raise Stop

    monkeypatch.setattr(measured, "measured_split", split)
    with pytest.raises(Stop):
        plan_validate.main([MODEL, "--tiny", "--partition", "measured", "--stages", "2", "--out", str(tmp_path), *flag])
    assert asked == [bool(flag)]

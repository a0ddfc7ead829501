"""`stagewise bench structured` at toy sizes: the engines' rows (llguidance always; xgrammar when
it is installed), the decode rows, free against held to a schema, with the same token counts, and
the server rows (ours only: the baselines are optional dependencies)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")

from stagewise.cli import main  # noqa: E402


def test_a_tiny_run(tmp_path):
    assert main(["bench", "structured", "--tiny", "--batch-sizes", "1,2", "--servers", "stagewise",
                 "--out", str(tmp_path)]) == 0
    [result] = tmp_path.glob("*-structured.json")
    data = json.loads(result.read_text())
    engines = {row["engine"]: row for row in data["engines"]}
    ll = engines["llguidance"]
    assert ll["licence"] == "MIT" and ll["requires"] == [] and ll["answer_tokens"] > 100
    assert set(ll["mask_and_advance_s"]) == {"1", "2"} and all(v > 0 for v in ll["mask_and_advance_s"].values())
    assert ll["coverage"]["$ref / $defs"] and not ll["coverage"]["uniqueItems"]
    assert [r["batch"] for r in data["decode"]] == [1, 2]
    assert all(r["tpot_free_s"] > 0 and r["tpot_json_schema_s"] > 0 for r in data["decode"])
    # The steps' own time on masks: some, and less than the whole constrained step.
    assert all(0 < r["constraint_step_s"] < r["tpot_json_schema_s"] for r in data["decode"])
    [ours] = data["servers"]
    assert ours["server"] == "stagewise" and ours["valid"] == ours["requests"] == 2
    assert ours["tpot_free_s"] > 0 and ours["tpot_held_s"] > 0 and ours["first_held_ttft_s"] > 0
    assert "mask cost" in result.with_suffix(".md").read_text()


def test_bad_batch_sizes_are_named(capsys):
    assert main(["bench", "structured", "--tiny", "--batch-sizes", "0"]) == 2
    assert "--batch-sizes takes batch sizes >= 1" in capsys.readouterr().err
    assert main(["bench", "structured", "--tiny", "--servers", "stagewise,tgi"]) == 2
    assert "--servers takes some of stagewise, llama.cpp, vllm or none" in capsys.readouterr().err

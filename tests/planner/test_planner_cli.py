"""`stagewise plan ...` end to end through main(argv): search, --config, ranks, pictures, bad input."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib

import pytest

from stagewise.cli import main as stagewise_main
from stagewise.planner import cli
from stagewise.planner.models import MODELS_DIR
from stagewise.trace import read_chrome_trace

QWEN3_4B = str(MODELS_DIR / "qwen3-4b.json")


def _run(capsys, *argv):
    code = stagewise_main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_search_json_rows_and_breakdown(capsys):
    code, out, _ = _run(capsys, "qwen3-4b", "--num-devices", "4", "--tp-sizes", "1", "2", "--pp-sizes", "1", "2",
                        "--input-length", "512", "--output-length", "64", "--batch", "4", "--json")
    assert code == 0
    data = json.loads(out)
    got = {(r["tp"], r["pp"], r["dp"]) for r in data["layouts"]}
    assert got == {(1, 1, 4), (1, 2, 2), (2, 1, 2), (2, 2, 1)}
    row = next(r for r in data["layouts"] if (r["tp"], r["pp"]) == (2, 2))
    assert row["parallel"] == "TP=2 | PP=2 | DP=1" and row["stage_ranges"] == [[0, 18], [18, 36]]
    assert "| PP Compute " in row["decode"]["breakdown"] and "PP Bubble" in row["decode"]["breakdown"]
    assert row["decode"]["num_microbatches"] == 2
    assert row["confidence"]["validated"] is False and row["confidence"]["expected_error_pct"] is None
    # The validation record covers small TP sizes on a CPU profile; TP=8 is beyond any it holds.
    wide = _run(capsys, "qwen3-4b", "--num-devices", "8", "--tp-sizes", "8", "--pp-sizes", "1", "--json")[1]
    reasons = json.loads(wide)["layouts"][0]["confidence"]["not_validated_because"]
    assert any(r.startswith("TP=8 outside validated 1..") for r in reasons), reasons


def test_search_text_and_trailing_model_id(capsys):
    # The model id may trail the last size list, as throughput-optimizer command lines put it.
    code, out, _ = _run(capsys, "--num-devices", "8", "--input-length", "2048", "--output-length", "512",
                        "--tp-sizes", "1", "2", "--pp-sizes", "1", "2", "4", QWEN3_4B)
    assert code == 0
    assert "TP=1 | PP=4 | DP=2" in out and "TP=2 | PP=4 | DP=1" in out
    assert "PP Compute" in out and "TPOT ms" in out


def test_empty_pp_sizes_means_powers_of_two(capsys):
    code, out, _ = _run(capsys, "qwen3-4b", "--num-devices", "8", "--tp-sizes", "1", "--pp-sizes",
                        "--input-length", "64", "--output-length", "8", "--json")
    assert code == 0
    assert sorted(r["pp"] for r in json.loads(out)["layouts"]) == [1, 2, 4, 8]
    code, out, _ = _run(capsys, "qwen3-4b", "--num-devices", "8", "--tp-sizes", "1",
                        "--input-length", "64", "--output-length", "8", "--json")
    assert [r["pp"] for r in json.loads(out)["layouts"]] == [1]  # not given: PP fixed to 1


def test_serving_config(capsys, tmp_path):
    path = tmp_path / "serving.yaml"
    path.write_text("model: qwen3-4b\ninput_length: 256\noutput_length: 32\n"
                    "parallel_config:\n  world_size: 8\n  tp_size: 2\n  pp_size: 2\n  dp_size: 2\n")
    code, out, _ = _run(capsys, "--config", str(path), "--json")
    assert code == 0
    [row] = json.loads(out)["layouts"]
    assert (row["tp"], row["pp"], row["dp"]) == (2, 2, 2)
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel_config:\n  world_size: 8\n  tp_size: 2\n  pp_size: 2\n  dp_size: 1\n")
    code, _, err = _run(capsys, "qwen3-4b", "--config", str(bad), "--input-length", "8", "--output-length", "8")
    assert code == 2 and "world_size=8 must equal tp_size * pp_size * dp_size = 2 * 2 * 1 = 4" in err


def test_lengths_default_to_a_stated_workload(capsys):
    code, out, _ = _run(capsys, "qwen3-4b", "--num-devices", "2", "--tp-sizes", "1", "--json")
    assert code == 0
    workload = json.loads(out)["workload"]
    assert (workload["input_length"], workload["output_length"]) == (cli.DEFAULT_INPUT_LENGTH, cli.DEFAULT_OUTPUT_LENGTH)


def test_help_names_every_plan_command_and_the_default_workload(capsys):
    with pytest.raises(SystemExit) as exit_:
        stagewise_main(["plan", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for command in ("stagewise plan memory", "stagewise plan ranks", "stagewise plan validate"):
        assert command in out
    assert "else 2048" in out and "else 512" in out
    assert "seed" not in out.lower() and "§" not in out


def test_ranks_of_world_8_tp_2_pp_4(capsys):
    code, out, _ = _run(capsys, "ranks", "--world-size", "8", "--tp", "2", "--pp", "4", "--json")
    assert code == 0
    data = json.loads(out)
    r4 = data["ranks"][4]
    assert r4["pp_group"] == [0, 2, 4, 6] and r4["pp_rank_in_group"] == 2 and r4["tp_group"] == [4, 5]
    code, _, err = _run(capsys, "ranks", "--world-size", "8", "--tp", "3", "--pp", "4")
    assert code == 2 and "tp * pcp * pp = 12 must divide world_size=8" in err


def test_plot_and_trace(capsys, tmp_path):
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    code, _, _ = _run(capsys, "qwen3-4b", "--num-devices", "4", "--tp-sizes", "1", "--pp-sizes", "4",
                      "--input-length", "128", "--output-length", "16", "--batch", "4", "--plot", str(png),
                      "--trace", str(trace))
    assert code == 0
    raw = png.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", raw[16:24])
    assert width == 1200 and height > 100
    idat = raw.index(b"IDAT")
    assert len(zlib.decompress(raw[idat + 4:idat + 4 + struct.unpack(">I", raw[idat - 4:idat])[0]])) == \
        height * (1 + 3 * width)
    data = json.loads(trace.read_text())
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"stage 0", "stage 1", "stage 2", "stage 3"}
    events = read_chrome_trace(trace)
    assert {e.cat for e in events} == {"compute", "comm", "bubble"}
    # Prefill: 4 microbatches; stage 0 only sends, stage 3 only receives.
    assert sum(1 for e in events if e.stage == 0 and e.name.startswith("prefill mb")) == 4
    assert not any(e.stage == 0 and e.name.startswith("recv") for e in events)
    assert not any(e.stage == 3 and e.name.startswith("send") and e.args["phase"] == "prefill" for e in events)
    # Decode: the last stage sends the sampled tokens back to stage 0.
    assert any(e.stage == 3 and e.name.startswith("send mb0 -> 0") for e in events)
    # Each stage's events tile the timeline without overlap up to the fill-drain latency.
    for s in range(4):
        spans = sorted((e.start_s, e.start_s + e.dur_s) for e in events if e.stage == s)
        assert all(b[0] >= a[1] - 2e-9 for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("argv, message", [
    (["qwen3-4b", "--num-devices", "8", "--input-length", "-5", "--output-length", "8"],
     "--input-length must be a positive integer, got -5"),
    (["qwen3-4b", "--num-devices", "8", "--output-length", "0"], "--output-length must be a positive integer, got 0"),
    (["qwen3-4b", "--input-length", "8", "--output-length", "8"], "--num-devices is required"),
    (["qwen3-4b", "--num-devices", "8", "--pp-sizes", "16", "--input-length", "8", "--output-length", "8"],
     "positive integer not greater than --num-devices=8"),
    (["qwen3-4b", "--num-devices", "8", "--tp-sizes", "3", "--input-length", "8", "--output-length", "8"],
     "no valid layout for 8 devices"),
    (["no-such-model", "--num-devices", "8", "--input-length", "8", "--output-length", "8"],
     "unknown model 'no-such-model'"),
    (["qwen3-4b", "--num-devices", "8", "--input-length", "8", "--output-length", "8", "--device-profile", "x"],
     "neither a built-in profile"),
    (["qwen3-4b", "--num-devices", "1", "--input-length", "8", "--output-length", "8", "--weight-quant", "q3"],
     "weight_quant must be one of ['q4_0', 'q4_1', 'q8_0']"),
    (["memory", "qwen3-4b", "--stages", "0"], "must be positive integers"),
    (["memory", "qwen3-4b", "--stages", "40"], "without layers"),
    (["validate", "smollm2-135m", "--stages", "0", "--device-profile", "cpu-generic"],
     "--stages, --batch, --input-length, --repeats must be >= 1"),
])
def test_bad_input_is_a_clear_error(capsys, argv, message):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_unknown_model_type(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    code, _, err = _run(capsys, "memory", str(path), "--stages", "2")
    assert code == 2 and "model_type 'mamba' is not supported" in err


def test_console_script_runs_plan():
    out = subprocess.run([sys.executable, "-m", "stagewise.cli", "plan", "ranks", "--world-size", "4", "--tp", "2",
                          "--pp", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "pp groups: [0, 2] [1, 3]" in out.stdout

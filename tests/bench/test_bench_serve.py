"""`stagewise bench serve`: its load (Poisson arrivals at the asked rate, log-normal lengths within
their bounds, prompts of at least the drawn tokens, the same from the same seed), the workloads
with shared prefixes, and tiny runs against `stagewise serve` alone, with its prefix cache and
without."""

from __future__ import annotations

import collections
import json
import random
import statistics
import types

import pytest

from stagewise.bench.serve.compare import _budget_compare, _target
from stagewise.bench.serve.workloads import OUTPUT, PROMPT, TINY, Sizes, num_requests, workload
from stagewise.cli import main


def words(text: str) -> int:
    return len(text.split())


def test_the_load_is_poisson_at_the_rate_with_bounded_lengths():
    reqs = workload("sharegpt", 400, 4.0, words, seed=3)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.15)
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.2)  # exponential: sd = mean
    assert all(PROMPT.lo <= r.prompt_tokens for r in reqs) and all(OUTPUT.lo <= r.max_tokens <= OUTPUT.hi for r in reqs)
    assert all(words(r.prompt) == r.prompt_tokens for r in reqs)
    assert statistics.median(r.max_tokens for r in reqs) == pytest.approx(OUTPUT.median, rel=0.2)
    assert workload("sharegpt", 50, 4.0, words, seed=3) == reqs[:50]
    assert workload("sharegpt", 50, 4.0, words, seed=4) != reqs[:50]
    shape = random.Random(0)
    assert PROMPT.draw(shape) != PROMPT.draw(shape)


def test_shared_prefix_workloads():
    """A system prompt before every question; 8 (tiny: 2) questions per document; conversations
    whose later turns follow the first: n requests in all, a conversation's turns counted."""
    sizes = Sizes()
    reqs = workload("system-prompt", 20, 2.0, words, seed=1, sizes=sizes)
    system = reqs[0].prompt.split("\n\n")[0]
    assert words(system) >= sizes.system and all(r.prompt.startswith(system + "\n\n") for r in reqs)
    assert len({r.prompt for r in reqs}) == 20 and all(words(r.prompt) == r.prompt_tokens for r in reqs)
    reqs = workload("documents", 20, 2.0, words, seed=1, sizes=sizes)
    docs = collections.Counter(r.prompt.split("\n\n")[0] for r in reqs)
    assert len(docs) == 3 and sorted(docs.values()) == [4, 8, 8] and all(words(d) >= 2000 for d in docs)
    reqs = workload("multi-turn", 10, 2.0, words, seed=1, sizes=sizes)
    assert [len(r.turns) for r in reqs] == [3, 3, 1] and num_requests(reqs) == 10
    assert num_requests(workload("multi-turn", 5, 2.0, words, seed=1, sizes=TINY)) == 5
    with pytest.raises(ValueError, match="--workload takes one of sharegpt"):
        workload("chat", 5, 2.0, words)


@pytest.mark.parametrize(("stages", "kind"), [(2, "multi-turn"), (1, "system-prompt")])
def test_a_tiny_run_against_stagewise_serve(tmp_path, stages, kind):
    """Ours as it starts by default, without its prefix cache, then with a TPOT target given; as one
    process and as a pipeline. The shared system prompt's blocks are found cached."""
    assert main(["bench", "serve", "--tiny", "--server-baseline", "none", "--rates", "4", "--linear-precision", "int8",
                 "--tpot-target", "50", "--stages", str(stages), "--workload", kind, "--out", str(tmp_path)]) == 0
    [result] = tmp_path.glob("*-serve.json")
    data = json.loads(result.read_text())
    name = "stagewise int8" + ("" if stages == 1 else f", {stages} stages")
    assert list(data["rows"]) == [name, f"{name}, no prefix cache", f"{name}, TPOT target 50 ms"]
    assert data["machine"]["stages"] == stages and data["machine"]["workload"] == kind
    for [row] in data["rows"].values():
        assert row["completed"] == 4 and row["failed"] == 0 and row["tok_per_s"] > 0
        assert row["ttft_p50_s"] > 0 and row["tpot_p50_s"] > 0
    [off] = data["rows"][f"{name}, no prefix cache"]
    assert off["cache_hit_rate"] == 0
    if kind == "system-prompt":
        assert data["rows"][name][0]["cache_hit_rate"] > 0.3
    text = result.with_suffix(".md").read_text()
    assert f"{name}, TPOT target 50 ms" in text and "against itself without the prefix cache" in text


def row(rate: float, req_per_s: float, tpot_p99_s: float) -> dict:
    return {"rate": rate, "req_per_s": req_per_s, "tpot_p99_s": tpot_p99_s}


def test_the_comparison_at_equal_p99_tpot_and_the_target_it_gives():
    rows = {"llama.cpp": [row(1, 0.6, 0.019), row(2, 0.8, 0.021), row(4, 0.7, 0.030)],
            "stagewise exact": [row(1, 1.0, 0.020), row(2, 1.5, 0.040)],
            "stagewise int8, TPOT target 16.8 ms": [row(1, 1.0, 0.015), row(2, 1.9, 0.021)],
            "stagewise slow": [row(1, 1.0, 0.050)]}
    compare = _budget_compare(rows)
    assert compare["tpot_p99_budget_s"] == 0.021 and compare["llama_cpp_req_per_s"] == 0.8
    ours = compare["servers"]
    assert ours["stagewise exact"] == {"req_per_s": 1.0, "rate": 1, "ratio": pytest.approx(1.25)}
    assert ours["stagewise int8, TPOT target 16.8 ms"]["ratio"] == pytest.approx(1.9 / 0.8)
    assert ours["stagewise slow"] == {"req_per_s": 0.0, "rate": None, "ratio": 0.0}
    args = types.SimpleNamespace(tpot_target="auto")
    assert _target(args, rows) == pytest.approx(16.8)
    assert _target(args, {}) is None  # no baseline ran: no target to derive
    assert _target(types.SimpleNamespace(tpot_target="none"), rows) is None
    assert _target(types.SimpleNamespace(tpot_target="12.5"), rows) == 12.5


@pytest.mark.parametrize("argv, message", [
    (["--linear-precision", "int4"], "--linear-precision takes exact and/or int8"),
    (["--tpot-target", "0"], "--tpot-target takes auto, none or milliseconds > 0"),
    (["--tpot-target", "fast"], "--tpot-target takes auto, none or milliseconds > 0"),
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype takes auto, int8, fp8_e4m3 (several: comma-separated), got 'int4'"),
    (["--stages", "1,2"], "serve --stages takes one number of stages >= 1, got '1,2'"),
    (["--stages", "0"], "serve --stages takes one number of stages >= 1, got '0'"),
    (["--server-baseline", "sglang"], "--server-baseline takes llama.cpp, vllm (both: llama.cpp,vllm) or none"),
    (["--server-baseline", "vllm", "--vllm-python", "/nonexistent/python"], "cannot import vllm"),
])
def test_bad_serve_options_are_named(argv, message, capsys):
    assert main(["bench", "serve", "--tiny", "--server-baseline", "none", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_compact_kv_cache_run_is_started_and_named_with_it(monkeypatch):
    import stagewise.bench.serve.compare as compare

    started = []
    monkeypatch.setattr(compare, "Server", lambda name, argv, health, env: started.append(argv))
    compare._ours("smollm2-135m", 1, {}, "int8", 13.7, 2, True, "int8")
    compare._ours("smollm2-135m", 1, {}, "int8", 13.7, 2, True)
    with_kv, default = started
    assert with_kv[with_kv.index("--kv-cache-dtype") + 1] == "int8" and "--kv-cache-dtype" not in default
    assert compare._name("int8", 13.7, 2, True, "int8") == "stagewise int8, int8 KV cache, 2 stages, TPOT target 13.7 ms"
    assert compare._name("int8", 13.7, 2) == "stagewise int8, 2 stages, TPOT target 13.7 ms"

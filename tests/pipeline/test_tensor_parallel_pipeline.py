"""Stages of several ranks as processes (tensor and context parallel) against the single process:
greedy and seeded-sampling tokens identical and log-probabilities within float32 rounding, for
tiny random models with GQA and MQA heads, stages of equal and of different TP sizes, batched
prompts of different lengths with cancellations in between, prompts prefilled in chunks under DCP
and PCP; a rank that dies mid-generation;
the real SmolLM2 at tp 3. The maths of each layer under TP and CP is held to transformers and to
the single process in tests/model; here the runtime: rank processes, the leader's fan-out, the
groups, the driver's watch over every rank."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

import stagewise
from stagewise.launch.local import spawn_stages
from stagewise.parallel.runplan import RunPlan

from helpers.processes import alive, gone

from helpers.hf_models import save_random

transformers = pytest.importorskip("transformers")

NEW = 6
SMALL = dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, max_position_embeddings=256, intermediate_size=96)
MODELS = {
    # GQA 8:2 (tp 4 replicates each KV head on two ranks: room for dcp 2)
    "llama-gqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
    # MQA: one KV head, on every rank
    "llama-mqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    # Qwen2.5's shape: q/k/v biases, tied embeddings
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    # Falcon-40B's layout: parallel attention and MLP, one all-reduce a layer
    "falcon-40b": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256,
        new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=96, tie_word_embeddings=False)),
}


def _prompts(n: int, seed: int, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 101) for _ in range(rng.randint(1, longest))] for _ in range(n)]


SAMPLED = dict(temperature=0.9, top_k=30, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """name -> (folder, prompts, single-process greedy tokens, sampled tokens, greedy logprobs)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            save_random(MODELS[name], folder)
            prompts = _prompts(5, seed=1, longest=70)  # some over a 32-position block (dcp or pcp 2)
            with stagewise.Pipeline(str(folder), max_model_len=128, max_num_seqs=8) as single:
                greedy = single.generate(prompt_token_ids=prompts, max_new_tokens=NEW, ignore_eos=True, logprobs=0)
                sampled = single.generate(prompt_token_ids=prompts, max_new_tokens=NEW, ignore_eos=True, **SAMPLED)
            cache[name] = (folder, prompts, [c.token_ids for c in greedy], [c.token_ids for c in sampled],
                           [[lp.logprob for lp in c.logprobs] for c in greedy])
        return cache[name]

    return get


def _check_against_single(pipe, tiny) -> None:
    """The single process's tokens and logprobs; the second call's prompts start after the blocks
    the first call left cached (a block: 16 positions on each context-parallel rank), on every rank."""
    folder, prompts, greedy, sampled, logprobs = tiny
    outs = pipe.generate(prompt_token_ids=prompts, max_new_tokens=NEW, ignore_eos=True, logprobs=0)
    assert [c.token_ids for c in outs] == greedy
    for c, want in zip(outs, logprobs):
        got = [lp.logprob for lp in c.logprobs]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)
    outs = pipe.generate(prompt_token_ids=prompts, max_new_tokens=NEW, ignore_eos=True, **SAMPLED)
    assert [c.token_ids for c in outs] == sampled
    block = 16 * pipe.plan.dcp * pipe.plan.pcp
    assert [c.cached_tokens for c in outs] == [(len(p) - 1) // block * block for p in prompts]


def _cancel_some_then_check(pipe, tiny) -> None:
    """Requests cancelled mid-generation free their KV on every rank; the next run is exact."""
    from stagewise.engine.params import SamplingParams

    folder, prompts, greedy, _, _ = tiny
    driver, results, polls = pipe.driver, {}, 0
    for rid, prompt in enumerate(prompts):
        driver.add(1000 + rid, prompt, SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))
    while len(results) < len(prompts):
        for out in driver.poll(0.02):
            results[out.request_id - 1000] = out
        polls += 1
        if polls == 3:
            for rid in (0, 2):
                driver.cancel(1000 + rid)
    for rid, out in results.items():
        assert out.token_ids == greedy[rid][:len(out.token_ids)], rid
    while pipe.status().get("running") != 0:
        driver.poll(0.05)
    assert [c.token_ids for c in pipe.generate(prompt_token_ids=prompts, max_new_tokens=NEW,
                                               ignore_eos=True)] == greedy


# The last column: prompt tokens per step (chunked prefill; the single process prefills whole prompts).
@pytest.mark.parametrize(("name", "stages", "tp", "dcp", "pcp", "chunk"), [
    ("llama-gqa", 2, 2, 1, 1, 8192),  # two stages of two TP ranks: 4 processes
    ("llama-gqa", 1, 4, 2, 1, 16),    # KV heads replicated on 2 ranks each, their sequence sharded over them
    ("llama-mqa", 1, 2, 2, 1, 7),     # the one KV head's sequence over both ranks; prompts in chunks of 7
    ("llama-mqa", 2, 1, 1, 2, 5),     # every prompt chunk split head-tail over 2 ranks, on both stages
    ("llama-gqa", 1, 2, 1, 2, 8192),  # PCP x TP
    ("qwen2", 2, 2, 1, 1, 7),         # q/k/v biases split with their heads; prompts in chunks of 7
    ("qwen3-moe", 2, 2, 1, 1, 8192),  # experts split over TP ranks, on both stages
    ("falcon-40b", 1, 4, 2, 1, 8192), # KV heads on 2 ranks each, sharded over them
])
def test_tensor_and_context_parallel_equal_the_single_process(tiny_models, name, stages, tp, dcp, pcp, chunk):
    tiny = tiny_models(name)
    with stagewise.Pipeline(str(tiny[0]), stages=stages, tp=tp, dcp=dcp, pcp=pcp, max_model_len=128, max_num_seqs=8,
                            interleave_size=4, max_prefill_tokens=chunk) as pipe:
        assert len(pipe.driver.processes.pids) == stages * tp * pcp and pipe.plan.max_prefill_tokens == chunk
        _check_against_single(pipe, tiny)
        _cancel_some_then_check(pipe, tiny)


def test_stages_of_different_tp_sizes(tiny_models):
    """Stage 0 on two TP ranks, stage 1 on one: heterogeneous machines."""
    tiny = tiny_models("llama-gqa")
    plan = RunPlan.from_dict({"model": str(tiny[0]), "max_model_len": 128, "max_num_seqs": 8,
                              "stages": [{"layers": "0-2", "tp": 2, "threads": 1}, {"layers": "2-4", "threads": 1}]})
    assert plan.members == [(0, 0), (0, 1), (1, 0)]
    procs, addresses = spawn_stages(plan)
    with stagewise.Pipeline.attach(plan, addresses=addresses, processes=procs) as pipe:
        _check_against_single(pipe, tiny)


def test_a_rank_that_dies_ends_the_stages_requests_naming_it(tiny_models):
    from stagewise.engine.params import SamplingParams

    tiny = tiny_models("llama-gqa")
    pipe = stagewise.Pipeline(str(tiny[0]), stages=2, tp=2, max_model_len=256, max_num_seqs=4)
    pids, driver = pipe.driver.processes.pids, pipe.driver
    try:
        for rid, prompt in enumerate([[5, 6, 7], [8, 9]]):
            driver.add(rid, prompt, SamplingParams(max_new_tokens=240, temperature=0.0, ignore_eos=True))
        outs, deadline = [], time.monotonic() + 60
        while not driver.take_tokens():  # mid-generation, whatever the machine's speed
            outs += driver.poll(0.01)
            assert time.monotonic() < deadline and not outs
        os.kill(pids[3], signal.SIGKILL)  # stage 1's second TP rank
        struck = time.monotonic()
        while len(outs) < 2:
            outs += driver.poll(0.05)
            assert time.monotonic() - struck < 10
        ended = time.monotonic()
    finally:
        pipe.close()
    assert ended - struck < 5.0
    for out in outs:
        assert out.finish_reason == "error" and "stage 1 rank 1" in out.error, out.error
    gone(pids)  # waits up to 10 s
    assert not any(alive(p) for p in pids), "rank processes left behind"


@pytest.mark.parametrize("stages", [1, 2])
def test_smollm2_at_tp_3_answers_like_the_single_process(stages):
    """SmolLM2 has 9 query heads and 3 KV heads: tp 3 gives each rank 3 and 1."""
    question = ["generate", "smollm2-135m", "--chat", "--prompt", "What is the capital of France?",
                "--max-new-tokens", "12", "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    single = subprocess.run([sys.executable, "-m", "stagewise.cli", *question], capture_output=True, text=True,
                            timeout=600, env=env)
    assert single.returncode == 0, single.stderr
    parallel = subprocess.run([sys.executable, "-m", "stagewise.cli", *question, "--tp", "3", "--stages",
                               str(stages)], capture_output=True, text=True, timeout=600, env=env)
    assert parallel.returncode == 0, parallel.stderr
    import json

    want, got = json.loads(single.stdout), json.loads(parallel.stdout)
    want, got = want["completions"][0], got["completions"][0]
    assert got["token_ids"] == want["token_ids"] and "Paris" in got["text"]

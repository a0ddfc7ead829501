"""Speculative decoding across stage processes and the ranks of a stage: the greedy tokens of every
layout equal the single process's without drafts, and log-probabilities agree within float32
rounding, while drafts were both accepted and rejected (each stage and rank rolled the rejected
ones back, or the next step would have failed on it). The acceptance rule itself and the KV each
stage keeps are held in tests/engine/test_speculative.py."""

from __future__ import annotations

import random

import pytest

import stagewise

from helpers.hf_models import save_random

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, max_position_embeddings=256, intermediate_size=96)
MODELS = {
    "llama-gqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
}
NEW = 24
LAYOUTS = [("llama-gqa", dict(stages=2)), ("llama-gqa", dict(stages=3)), ("llama-gqa", dict(tp=2)),
           ("llama-mqa", dict(tp=2, dcp=2)), ("llama-mqa", dict(pcp=2)), ("qwen3-moe", dict(stages=2))]


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (prompt lookup finds matches) and one that does not."""
    rng = random.Random(3)
    base = [rng.randrange(3, 101) for _ in range(9)]
    return [base * 4, base[:4] * 5 + [11], [rng.randrange(3, 101) for _ in range(7)], base * 2 + base[:5]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (folder, single-process greedy completions without drafts)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            save_random(MODELS[name], folder)
            with stagewise.Pipeline(str(folder), max_model_len=128, max_num_seqs=8) as single:
                cache[name] = (folder, single.generate(prompt_token_ids=_prompts(), max_new_tokens=NEW,
                                                       ignore_eos=True, logprobs=0))
        return cache[name]
    return get


@pytest.mark.parametrize("name,layout", LAYOUTS, ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in lay.items())}"
                                                     for n, lay in LAYOUTS])
def test_greedy_tokens_equal_the_single_process_without_drafts(models, name, layout):
    folder, expected = models(name)
    with stagewise.Pipeline(str(folder), max_model_len=128, max_num_seqs=8, speculative="ngram",
                            num_speculative_tokens=3, **layout) as pipe:
        got = pipe.generate(prompt_token_ids=_prompts(), max_new_tokens=NEW, ignore_eos=True, logprobs=0)
        stats = pipe.last_stats
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected):
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    drafted, accepted = sum(c.draft_tokens for c in got), sum(c.accepted_tokens for c in got)
    assert 0 < accepted < drafted  # accepted and rejected drafts both happened
    assert stats["draft_tokens"] == drafted and stats["tokens_per_step"] > 1


def test_seeded_sampling_over_two_stages_gives_tokens_of_the_right_count(models):
    folder, _ = models("llama-gqa")
    with stagewise.Pipeline(str(folder), max_model_len=128, stages=2, speculative="ngram") as pipe:
        got = pipe.generate(prompt_token_ids=_prompts(), max_new_tokens=NEW, ignore_eos=True, temperature=0.8,
                            top_k=20, seed=5, logprobs=1)
    for c in got:
        assert len(c.token_ids) == NEW == len(c.logprobs) and all(0 <= t < 101 for t in c.token_ids)
        assert [lp.token for lp in c.logprobs] == c.token_ids


@pytest.mark.parametrize("layout", [dict(), dict(stages=2)], ids=["one-process", "stages2"])
def test_a_draft_model_in_stage_0_keeps_the_greedy_tokens(models, tmp_path, layout):
    """The model drafting for itself (its int8 linears: most drafts accepted) and another model of
    the same vocabulary (most rejected): the tokens are the single process's either way."""
    folder, expected = models("llama-gqa")
    other = tmp_path / "other"
    save_random(MODELS["llama-mqa"], other)
    for draft, most_accepted in ((folder, True), (other, False)):
        with stagewise.Pipeline(str(folder), max_model_len=128, max_num_seqs=8, speculative=f"draft:{draft}",
                                num_speculative_tokens=3, **layout) as pipe:
            got = pipe.generate(prompt_token_ids=_prompts(), max_new_tokens=NEW, ignore_eos=True)
            stats = pipe.last_stats
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        assert (stats["acceptance"] > 0.5) == most_accepted


def test_a_draft_model_of_another_vocabulary_is_refused(models, tmp_path):
    folder, _ = models("llama-gqa")
    save_random(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**SMALL, "vocab_size": 64}, num_attention_heads=4, num_key_value_heads=2)), tmp_path / "small")
    with pytest.raises(ValueError, match="vocabulary of 64 tokens, the target 101"):
        stagewise.Pipeline(str(folder), max_model_len=128, speculative=f"draft:{tmp_path / 'small'}")


def test_smollm2_with_drafts_gives_its_greedy_text_and_stops_where_it_did():
    """The real SmolLM2: greedy tokens and text as without drafts, a stop string met inside a step's
    accepted drafts ending the text where it ended without them."""
    prompts = ["Count from 1 to 40, separated by commas.", "Repeat exactly: red, green, blue, red, green, blue."]
    kwargs = dict(chat=True, max_new_tokens=80, temperature=0.0)
    with stagewise.Pipeline("smollm2-135m") as single:
        want = single.generate(prompts, **kwargs)
        want_stop = single.generate(prompts, stop=["8901", "blue, red"], **kwargs)
    with stagewise.Pipeline("smollm2-135m", speculative="ngram", num_speculative_tokens=5) as pipe:
        got = pipe.generate(prompts, **kwargs)
        got_stop = pipe.generate(prompts, stop=["8901", "blue, red"], **kwargs)
    assert [(c.text, c.token_ids) for c in got] == [(c.text, c.token_ids) for c in want]
    assert sum(c.accepted_tokens for c in got) > 10
    assert [(c.text, c.finish_reason) for c in got_stop] == [(c.text, c.finish_reason) for c in want_stop]
    assert all(c.finish_reason == "stop" for c in got_stop)

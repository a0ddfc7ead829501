"""Tiny random models and comparisons for the tests of a compact KV cache (``kv_cache_dtype``
int8 / fp8_e4m3) at the engine and pipeline level: greedy runs with log-probabilities, held to a
reference run token for token and log-probability within stated tolerances.

Why the tolerances are not the float cache's 1e-4 alone: a compact cache stores each token's head
row as one-byte codes, ``round(x / scale)`` with ``scale = half(amax / 127)`` (int8), and every
query reads those. Two runs whose K/V differ by float rounding only (a step's matmul over another
number of rows: another batch, chunk or stage group; a TP all-reduce; a CP rank's LSE merge; all
of which the float cache's layout tests see as ~1e-6) now and then round an element to the
neighbouring code, or a row's scale to the neighbouring float16, and the later layers' K/V of that
request follow. Measured on these models (16 prompts each, prefilled alone, in one batch, in
chunks of 7; the layouts of tests/pipeline/test_compact_kv_pipeline.py): such a request's
log-probabilities move by up to 4e-3 (int8) and 8e-3 (e4m3), while most requests have no changed
code and match within 1e-6. So a run is held to

- the reference's greedy tokens (its prompts chosen with margins no such change can close),
- every log-probability within :data:`LAYOUT_ATOL` (:data:`FP8_LAYOUT_ATOL`): a scale read for
  another token, raw codes or a lost scale move them by 1e-1 and more;
- at least one request within the float cache's :data:`FLOAT_ATOL` at every step: a path that
  reads K/V other than as the cache stores them moves every request. (The first compact cache let
  a prompt's first chunk and one process's decode rows attend over their own K/V unquantised,
  while CP ranks, drafts and later chunks read the codes: 2e-4 to 1.5e-2 at every decode step,
  within LAYOUT_ATOL for DCP and PCP, but no request within 1e-4.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import transformers

LAYOUT_ATOL = 1e-2
"""Log-probabilities of two runs over the same int8 cache whose K/V differ by float rounding
only (layouts, chunking, prefix-cache hits, drafts): see the module's docstring (measured up to
4e-3)."""
FP8_LAYOUT_ATOL = 3e-2
"""The same for an e4m3 cache, whose neighbouring codes lie up to 1/8 of a value apart rather
than 1/127 of the row's largest: a changed code moves more (measured up to 8e-3)."""
FLOAT_ATOL = 1e-4
"""What the float cache's layout tests allow, and at least one request of a compact run must keep
(see the module's docstring: of the 5 requests of a layout test 0 to 3 had a changed code)."""
MIN_MARGIN = 2
"""The least gap between the greedy token's log-probability and the runner-up's that a reference
run's steps must have, in multiples of the tolerance it is held to, so that differences within
it (each of the two moving by at most that) cannot change a token."""

NEW = 6
"""Tokens each request generates."""

SMALL = dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, max_position_embeddings=256, intermediate_size=96)
MODELS = {
    # GQA 4:2: tp 2 splits the KV heads (one a rank).
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=2)),
    # MQA: tp 2 replicates the one KV head, dcp 2 shards its sequence over the two ranks.
    "llama-mqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    # q/k norms; one KV head (room for dcp 2 under tp 2).
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **SMALL, num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
}


def prompts(n: int, seed: int, longest: int) -> list[list[int]]:
    """``n`` random prompts of 1 to ``longest`` tokens (ids 3 to 100)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 101) for _ in range(rng.randint(1, longest))] for _ in range(n)]


@dataclass(frozen=True)
class Run:
    """A greedy run's tokens, each token's log-probability, and the runner-up's (for margins)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    runner_up: list[list[float]]
    cached_tokens: list[int]

    @property
    def min_margin(self) -> float:
        return min(a - b for row, ups in zip(self.logprobs, self.runner_up) for a, b in zip(row, ups))


def as_run(outs) -> Run:
    """The :class:`Run` of completions generated with ``logprobs=2`` (or more)."""
    assert [c.error for c in outs] == [None] * len(outs), [c.error for c in outs]
    return Run([c.token_ids for c in outs], [[e.logprob for e in c.logprobs] for c in outs],
               [[e.top[1][1] for e in c.logprobs] for c in outs], [c.cached_tokens for c in outs])


def greedy(pipe, prompt_ids: list[list[int]], new: int = NEW, **options) -> Run:
    """``pipe.generate`` of ``prompt_ids`` greedily, ``new`` tokens each, with the two most likely
    tokens' log-probabilities at every step."""
    return as_run(pipe.generate(prompt_token_ids=prompt_ids, max_new_tokens=new, ignore_eos=True, logprobs=2,
                                **options))


def clear_prompts(folder, candidates: list[list[int]], n: int, new: int = NEW, atol: float = LAYOUT_ATOL,
                  images: list | None = None, **options) -> tuple[list[int], Run]:
    """The indices of the first ``n`` of ``candidates`` (with their ``images``, when given) whose
    greedy steps all have a margin of at least ``(MIN_MARGIN + 1) * atol`` in one process
    (``stagewise.Pipeline(folder, **options)``), and that process's run of them together (a batch
    of its own: its margins move within ``atol``): a reference whose tokens no difference within
    ``atol`` can change (a random model's next token is often a near-tie)."""
    import stagewise

    pick = (lambda rows, keep: None if rows is None else [rows[i] for i in keep])
    with stagewise.Pipeline(str(folder), **options) as single:
        first = greedy(single, candidates, new, images=images)
        keep = [i for i, (lp, up) in enumerate(zip(first.logprobs, first.runner_up))
                if min(a - b for a, b in zip(lp, up)) >= (MIN_MARGIN + 1) * atol][:n]
        run = greedy(single, pick(candidates, keep), new, images=pick(images, keep))
    assert len(keep) == n and run.min_margin >= MIN_MARGIN * atol, (len(keep), run.min_margin)
    return keep, run


def max_logprob_diff(got: Run, want: Run) -> float:
    return max(abs(a - b) for g, w in zip(got.logprobs, want.logprobs) for a, b in zip(g, w))


def assert_same_run(got: Run, want: Run, atol: float = LAYOUT_ATOL, what: str = "", exact_rows: int = 1) -> None:
    """``got`` has ``want``'s tokens and its log-probabilities within ``atol``, those of at least
    ``exact_rows`` requests within the float cache's :data:`FLOAT_ATOL` at every step."""
    assert got.tokens == want.tokens, what
    worst = max_logprob_diff(got, want)
    assert worst <= atol, f"{what}: log-probabilities differ by {worst:.3g} > {atol}"
    rows = [max(abs(a - b) for a, b in zip(g, w)) for g, w in zip(got.logprobs, want.logprobs)]
    assert sum(d <= FLOAT_ATOL for d in rows) >= exact_rows, \
        f"{what}: fewer than {exact_rows} requests within {FLOAT_ATOL} (each request's largest difference: {rows})"

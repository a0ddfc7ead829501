"""Sampler: greedy, the temperature/top-k/top-p/min-p chain and the repetition penalty against
transformers' own processors, the presence and frequency penalties against their definition,
logprobs against log-softmax, seeded reproducibility, draw frequencies, and parameter validation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from stagewise.engine.params import SamplingParams
from stagewise.engine.sampling import History, Sampler, apply_penalties, make_generator, token_logprobs

transformers_lp = pytest.importorskip("transformers.generation.logits_process")

VOCAB = 97  # awkward size on purpose


def hf_filtered_logits(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The chain transformers' sampling applies, one row: ``[V]`` -> ``[V]`` with -inf where removed."""
    scores = row.float().unsqueeze(0)
    warpers = [transformers_lp.TemperatureLogitsWarper(p.temperature)]
    if p.top_k > 0:
        warpers.append(transformers_lp.TopKLogitsWarper(p.top_k, min_tokens_to_keep=1))
    if p.top_p < 1.0:
        warpers.append(transformers_lp.TopPLogitsWarper(p.top_p, min_tokens_to_keep=1))
    if p.min_p > 0.0:
        warpers.append(transformers_lp.MinPLogitsWarper(p.min_p, min_tokens_to_keep=1))
    for w in warpers:
        scores = w(None, scores)
    return scores.squeeze(0)


def settings_grid() -> list[SamplingParams]:
    temps = [0.3, 1.0, 1.7]
    top_ks = [0, 1, 5, 40, VOCAB, VOCAB + 10]
    top_ps = [1.0, 0.95, 0.5, 0.1, 1e-6]
    min_ps = [0.0, 0.05, 0.3, 1.0]
    return [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
            for t, k, p, m in itertools.product(temps, top_ks, top_ps, min_ps)]


def test_filtered_distribution_matches_transformers():
    params = settings_grid()
    # Spread-out logits (scale 3) so top-p cuts land in many places.
    logits = torch.randn(len(params), VOCAB) * 3
    assert all(row.unique().numel() == VOCAB for row in logits)  # no ties: top-p order is then unambiguous
    ours = Sampler.filtered_logits(logits, params)
    ours_probs = Sampler.filtered_probs(logits, params)
    for i, p in enumerate(params):
        ref = hf_filtered_logits(logits[i], p)
        kept = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(ours[i]), kept), f"row {i}: {p}"
        torch.testing.assert_close(ours_probs[i], torch.softmax(ref, dim=-1), rtol=1e-6, atol=1e-7)
        assert torch.all(ours_probs[i][~kept] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_top_k_ties_keep_every_tied_token(dtype):
    # Few distinct values: many ties at every top-k threshold.
    logits = torch.randint(0, 4, (6, VOCAB)).to(dtype)
    params = [SamplingParams(top_k=k, temperature=1.0) for k in (1, 2, 3, 10, 50, VOCAB)]
    ours = Sampler.filtered_logits(logits, params)
    for i, p in enumerate(params):
        ref = hf_filtered_logits(logits[i], p)
        assert torch.equal(torch.isfinite(ours[i]), torch.isfinite(ref))


def test_top_p_ties_keep_lower_ids():
    # Four equal logits: each token has probability 1/4. Ascending cumulative mass is
    # .25, .5, .75, 1 and top-p drops tokens while it is <= 1 - top_p.
    logits = torch.zeros(4, 4)
    top_ps = [0.5, 0.6, 0.3, 1e-3]
    expected_kept = [[0, 1], [0, 1, 2], [0, 1], [0]]
    ours = Sampler.filtered_logits(logits, [SamplingParams(top_p=p, temperature=1.0) for p in top_ps])
    for row, kept in zip(ours, expected_kept):
        assert torch.isfinite(row).nonzero().flatten().tolist() == kept


def test_tiny_top_p_keeps_only_the_argmax():
    logits = torch.randn(8, VOCAB)
    params = [SamplingParams(top_p=1e-9, temperature=t) for t in (0.1, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 100.0)]
    ours = Sampler.filtered_logits(logits, params)
    for i in range(8):
        assert torch.isfinite(ours[i]).nonzero().flatten().tolist() == [int(logits[i].argmax())]


def test_greedy_is_argmax(device):
    logits = torch.randn(16, VOCAB, device=device)
    logits[3, 10] = logits[3, 50] = logits[3].max() + 1  # a tie: argmax takes the lower id
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.3) for _ in range(16)]
    out = Sampler().sample(logits, params, [None] * 16)
    assert out.dtype == torch.long and out.shape == (16,)
    assert torch.equal(out, logits.argmax(dim=-1))
    assert int(out[3]) == 10


def test_mixed_batch_greedy_rows_and_top_k_one(device):
    # Distinct small integers: exact in bfloat16, so top_k=1 has no tie to choose from.
    logits = torch.stack([torch.randperm(VOCAB) for _ in range(6)]).to(device=device, dtype=torch.bfloat16)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(top_p=1e-9, seed=3)] * 2
    gens = [make_generator(p, device) for p in params]
    out = Sampler().sample(logits, params, gens)
    assert torch.equal(out, logits.float().argmax(dim=-1))


def test_empty_batch(device):
    out = Sampler().sample(torch.empty(0, VOCAB, device=device), [], [])
    assert out.shape == (0,) and out.dtype == torch.long


def _generate(logits_steps, params, device):
    """Runs several sampling steps; returns ``[steps, B]`` tokens."""
    sampler = Sampler()
    gens = [make_generator(p, device) for p in params]
    return torch.stack([sampler.sample(step, params, gens) for step in logits_steps])


def test_seeded_rows_are_reproducible_and_batch_independent(device):
    steps = [torch.randn(5, VOCAB, device=device) for _ in range(30)]
    target = SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2)] + [SamplingParams(temperature=1.0)]
    alone = _generate([s[2:3] for s in steps], [target], device)[:, 0]
    again = _generate([s[2:3] for s in steps], [target], device)[:, 0]
    in_batch = _generate(steps, others[:2] + [target] + others[2:] + [SamplingParams(temperature=0.0)], device)[:, 2]
    assert torch.equal(alone, again)
    assert torch.equal(alone, in_batch)
    other_seed = _generate([s[2:3] for s in steps], [SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=99)], device)
    assert not torch.equal(alone, other_seed[:, 0])  # 30 draws from ~20 tokens: identical only by a bug


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=6),
        SamplingParams(temperature=1.5, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.7),
    ],
    ids=["plain", "top_k", "top_p", "both"],
)
def test_draw_frequencies_match_probabilities(params):
    """Pearson chi-square of 20k seeded draws against the transformers-filtered distribution."""
    vocab, draws = 12, 20_000
    torch.manual_seed(0)
    logits = torch.randn(vocab) * 1.5
    probs = torch.softmax(hf_filtered_logits(logits, params), dim=-1).double()
    out = Sampler().sample(logits.expand(draws, vocab), [params] * draws, [None] * draws)
    counts = torch.bincount(out, minlength=vocab).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a filtered-out token was drawn"
    expected = probs[kept] * draws
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    dof = int(kept.sum()) - 1
    # Mean dof, sd sqrt(2 dof): allow ~6 sd plus slack, so only a wrong distribution fails.
    assert chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)) + 10, f"chi2={chi2:.1f} dof={dof}"


def test_seeded_draw_frequencies():
    """The per-request generator path draws from the same distribution as the batched one."""
    vocab, draws = 6, 4_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=1.0, seed=7)
    gen = make_generator(params)
    sampler = Sampler()
    out = torch.cat([sampler.sample(logits, [params], [gen]) for _ in range(draws)])
    probs = torch.softmax(logits[0].double(), dim=-1)
    counts = torch.bincount(out, minlength=vocab).double()
    chi2 = float(((counts - probs * draws) ** 2 / (probs * draws)).sum())
    assert chi2 < 5 + 6 * math.sqrt(10) + 10, f"chi2={chi2:.1f}"


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.0),
        ("temperature", -0.1),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_k", 1.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", float("nan")),
        ("seed", -1),
        ("seed", 2**64),
        ("seed", "7"),
        ("stop", ["ok", ""]),
        ("stop", ""),
        ("stop_token_ids", [3, -1]),
        ("stop_token_ids", [True]),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**{field: value})


def test_valid_edges_are_accepted():
    p = SamplingParams(max_new_tokens=1, temperature=0, top_k=0, top_p=1.0, seed=2**64 - 1, stop=("a",))
    assert p.greedy and p.stop == ["a"]
    assert SamplingParams(stop="STOP").stop == ["STOP"]  # a string alone is one stop string


def test_sample_checks_its_arguments():
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(3), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="one SamplingParams and one generator per row"):
        Sampler().sample(torch.zeros(2, 5), [SamplingParams()], [None, None])


# --- penalties and logprobs ----------------------------------------------------------------------

def test_repetition_penalty_equals_transformers_processor():
    """transformers' RepetitionPenaltyLogitsProcessor over the prompt and the output tokens."""
    logits = torch.randn(4, VOCAB) * 4
    seen = [([3, 5, 5, 90], [5, 7]), ([1], []), ([10, 20], [20, 30, 40, 40]), ([0, 96], [96])]
    for penalty in (0.5, 1.3, 2.0):
        params = [SamplingParams(repetition_penalty=penalty, temperature=0.0)] * 4
        ours = apply_penalties(logits, params, [History(p, o) for p, o in seen])
        for i, (prompt, output) in enumerate(seen):
            processor = transformers_lp.RepetitionPenaltyLogitsProcessor(penalty)
            ref = processor(torch.tensor([prompt + output]), logits[i : i + 1].clone())[0]
            torch.testing.assert_close(ours[i], ref, rtol=0, atol=0)


def test_presence_and_frequency_penalties_by_their_definition():
    """logit -= presence * [token in output] + frequency * (count in output); the prompt does not
    count (transformers has no such processor: this is OpenAI's definition)."""
    logits = torch.randn(2, VOCAB)
    history = History([4, 6], [7, 7, 7, 9])
    params = SamplingParams(presence_penalty=0.75, frequency_penalty=-0.5, temperature=0.0)
    ours = apply_penalties(logits, [params, SamplingParams()], [history, None])
    want = logits[0].clone()
    want[7] -= 0.75 + 3 * -0.5
    want[9] -= 0.75 + 1 * -0.5
    torch.testing.assert_close(ours[0], want)
    torch.testing.assert_close(ours[1], logits[1])  # a row without penalties is unchanged
    with pytest.raises(ValueError, match="row 0 has a penalty but no history"):
        apply_penalties(logits[:1], [params], [None])


def test_greedy_with_a_repetition_penalty_takes_the_penalised_argmax():
    logits = torch.zeros(1, VOCAB)
    logits[0, 11], logits[0, 12] = 3.0, 2.0  # 11 wins unless penalised: 3 / 2 = 1.5 < 2
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    assert Sampler().sample(logits, params, [None], [History([11])]).tolist() == [12]
    assert Sampler().sample(logits, [SamplingParams(temperature=0.0)], [None]).tolist() == [11]


def test_logprobs_are_the_log_softmax_of_the_logits():
    logits = torch.randn(3, VOCAB, dtype=torch.bfloat16)
    tokens = torch.tensor([4, 50, 96])
    out = token_logprobs(logits, tokens, [2, None, 0])
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert out[1] is None
    assert out[0].token == 4 and out[0].logprob == pytest.approx(ref[0, 4].item(), abs=1e-6)
    top, ids = ref[0].topk(2)
    assert [t for t, _ in out[0].top] == ids.tolist()
    assert [v for _, v in out[0].top] == pytest.approx(top.tolist(), abs=1e-6)
    assert out[2].top == () and out[2].logprob == pytest.approx(ref[2, 96].item(), abs=1e-6)


@pytest.mark.parametrize("field, value, match", [
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
    ("presence_penalty", 2.5, r"presence_penalty must be a number in \[-2, 2\]"),
    ("frequency_penalty", -3, r"frequency_penalty must be a number in \[-2, 2\]"),
    ("min_p", 1.5, r"min_p must be a number in \[0, 1\]"),
    ("logprobs", 21, r"logprobs must be None or an int in \[0, 20\]"),
    ("logprobs", True, "logprobs must be None or an int"),
])
def test_new_sampling_values_are_checked(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})

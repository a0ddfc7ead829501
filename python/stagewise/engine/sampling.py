"""Per-request sampling settings and the batched token sampler.

The chain is the one Hugging Face ``generate`` applies, in the same order and with the same
arithmetic, so a request sampled here sees the same candidate set and probabilities as under
transformers:

    penalties  ->  greedy argmax, or:  logits / temperature  ->  top-k  ->  top-p  ->  min-p  ->  draw

Penalties change the logits of tokens a request has already seen, greedy or not: the
repetition penalty (transformers' ``RepetitionPenaltyLogitsProcessor``) divides a positive
logit and multiplies a negative one by ``repetition_penalty`` for every token of the prompt and
of the output; the presence and frequency penalties (OpenAI's definition; transformers has no
such processor) subtract ``presence_penalty`` once and ``frequency_penalty`` per occurrence for
every token of the output. Min-p (``MinPLogitsWarper``) drops the tokens whose probability is
below ``min_p`` times the most likely one's.

Top-k keeps every token whose logit is >= the k-th largest (ties at the
threshold all survive). Top-p walks the tokens from least to most likely and
drops them while the cumulative probability stays <= 1 - top_p. Where top-p has
to choose between tokens of equal logit, the lower token id survives, matching
greedy decoding (``torch.argmax`` picks the lowest id among ties).

Each request may carry its own ``torch.Generator`` (see :func:`make_generator`);
a row draws exactly one uniform number from it per step, so its tokens depend on
its seed alone and not on what else shares the batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from stagewise.engine.params import SamplingParams, TokenLogprobs

__all__ = ["History", "Sampler", "apply_penalties", "inverse_cdf", "make_generator", "token_logprobs", "uniforms"]

class History:
    """The tokens one request has seen, for its penalties: the prompt (repetition) and the
    output so far (repetition, presence, frequency)."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt_ids: Iterable[int], output_ids: Iterable[int] = ()) -> None:
        self.prompt = frozenset(int(t) for t in prompt_ids)
        self.output: Counter[int] = Counter(int(t) for t in output_ids)

    def append(self, token: int) -> None:
        self.output[int(token)] += 1


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The request's own generator on ``device`` (None when it has no seed)."""
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


class Sampler:
    """Picks one token per row of a logits batch."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[History | None] | None = None,
    ) -> torch.Tensor:
        """``logits [B, V]`` (any float dtype) -> token ids ``LongTensor [B]``.

        ``params[i]``, ``generators[i]`` and ``histories[i]`` belong to row i; a None generator
        draws from torch's global generator for ``logits.device``; a row with a penalty needs
        its history.
        """
        _check_batch(logits, params, generators)
        if any(p.penalised for p in params):
            logits = apply_penalties(logits, params, histories or [None] * len(params))
        batch = logits.size(0)
        out = torch.empty(batch, dtype=torch.long, device=logits.device)
        if batch == 0:
            return out
        rows = [i for i, p in enumerate(params) if not p.greedy]
        out.copy_(logits.argmax(dim=-1))  # greedy rows keep this; sampled rows overwrite it below
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            probs = self.filtered_probs(logits.index_select(0, idx), [params[i] for i in rows])
            draws = uniforms(len(rows), [generators[i] for i in rows], logits.device)
            out.index_copy_(0, idx, inverse_cdf(probs, draws))
        return out

    @staticmethod
    def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution sampled from: ``logits [B, V]`` -> probabilities ``float32 [B, V]``.

        Every row must have temperature > 0. Filtered-out tokens get probability 0.
        """
        if any(p.greedy for p in params):
            raise ValueError("Sampler.filtered_probs: every row needs temperature > 0 (greedy rows take argmax)")
        scores = Sampler.filtered_logits(logits, params)
        return torch.softmax(scores, dim=-1)

    @staticmethod
    def filtered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k and top-p applied: ``logits [B, V]`` -> ``float32 [B, V]`` with -inf where removed."""
        batch, vocab = logits.shape
        dev = logits.device
        scores = logits.float()
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            scores = scores / torch.tensor(temps, dtype=torch.float32, device=dev).unsqueeze(1)

        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if all(k == vocab for k in ks) and all(p.top_p == 1.0 for p in params):
            return _min_p(scores, params)  # nothing else to filter: skip the sort

        # One ascending sort serves both filters. The vocab is flipped before a stable
        # sort so that among equal logits the higher id comes first: it is then the one
        # top-p drops first, and the lower id survives.
        sorted_scores, order = torch.sort(scores.flip(-1), dim=-1, stable=True)
        order = vocab - 1 - order

        if any(k < vocab for k in ks):
            # k-th largest value = element V-k of the ascending sort.
            pos = torch.tensor([vocab - k for k in ks], device=dev).unsqueeze(1)
            threshold = sorted_scores.gather(1, pos)
            sorted_scores = sorted_scores.masked_fill(sorted_scores < threshold, float("-inf"))

        if any(p.top_p < 1.0 for p in params):
            # Same arithmetic as transformers' TopPLogitsWarper on the top-k'd row: the
            # sorted values are identical, so softmax and cumsum round identically.
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            limit = torch.tensor([1.0 - p.top_p for p in params], dtype=torch.float32, device=dev).unsqueeze(1)
            drop = cumulative <= limit
            drop[:, -1] = False  # always keep the most likely token
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))

        return _min_p(torch.empty_like(scores).scatter_(1, order, sorted_scores), params)


def _min_p(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """MinPLogitsWarper's arithmetic on the rows with ``min_p`` > 0 (the most likely token kept)."""
    rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if not rows:
        return scores
    idx = torch.tensor(rows, device=scores.device)
    sub = scores.index_select(0, idx)
    probs = sub.softmax(dim=-1)
    limit = torch.tensor([params[i].min_p for i in rows], dtype=probs.dtype, device=probs.device).unsqueeze(1)
    drop = probs < limit * probs.amax(dim=-1, keepdim=True)
    drop.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
    return scores.index_copy(0, idx, sub.masked_fill(drop, float("-inf")))


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[History | None]) -> torch.Tensor:
    """``logits [B, V]`` -> float32 ``[B, V]`` with each row's penalties applied for the tokens of
    its history (see the module doc)."""
    scores = logits.float().clone()
    for i, (p, h) in enumerate(zip(params, histories, strict=True)):
        if not p.penalised:
            continue
        if h is None:
            raise ValueError(f"Sampler: row {i} has a penalty but no history of its tokens")
        row = scores[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(h.prompt | h.output.keys()), dtype=torch.long, device=scores.device)
            picked = row.index_select(0, seen)
            penalty = p.repetition_penalty
            row.index_copy_(0, seen, torch.where(picked < 0, picked * penalty, picked / penalty))
        if h.output and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            ids = torch.tensor(list(h.output.keys()), dtype=torch.long, device=scores.device)
            counts = torch.tensor(list(h.output.values()), dtype=torch.float32, device=scores.device)
            row.index_add_(0, ids, -(p.presence_penalty + p.frequency_penalty * counts))
    return scores


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int | None]) -> list[TokenLogprobs | None]:
    """Each row's chosen token's log-probability and the ``ks[i]`` most likely tokens' (None where
    ``ks[i]`` is None), from the float32 log-softmax of ``logits [B, V]``."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(ks)
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, idx).view(-1, 1)).view(-1).tolist()
    k_max = max(ks[i] for i in rows)
    top_lp, top_ids = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long())
    top_lp, top_ids, picked = top_lp.tolist(), top_ids.tolist(), tokens.index_select(0, idx).tolist()
    for j, i in enumerate(rows):
        k = ks[i]
        out[i] = TokenLogprobs(token=picked[j], logprob=chosen[j], top=tuple(zip(top_ids[j][:k], top_lp[j][:k])))
    return out


def _check_batch(logits: torch.Tensor, params: list, generators: list) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"Sampler.sample: argument 'logits' must be a 2-D float tensor [batch, vocab], "
            f"got shape {tuple(logits.shape)} dtype {logits.dtype}"
        )
    if logits.size(1) == 0:
        raise ValueError("Sampler.sample: argument 'logits' has an empty vocab dimension")
    if len(params) != logits.size(0) or len(generators) != logits.size(0):
        raise ValueError(
            f"Sampler.sample: need one SamplingParams and one generator per row: logits has "
            f"{logits.size(0)} rows, got {len(params)} params and {len(generators)} generators"
        )


def uniforms(n: int, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row: ``float64 [n]``; seeded rows each from their own generator."""
    u = torch.empty(n, dtype=torch.float64, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, dtype=torch.float64, device=device, generator=g)[0]
    return u


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row-wise draw: ``probs [n, V]``, ``uniforms [n]`` -> ``LongTensor [n]``.

    Picks the first token whose cumulative mass exceeds u * total. A zero-probability
    token never has a cumulative mass above that of the token before it, so it is
    never picked; the clamp covers u * total rounding up to the total.
    """
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    last_nonzero = probs.size(1) - 1 - (probs > 0).flip(-1).long().argmax(dim=-1)
    return torch.minimum(picked, last_nonzero)

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
from dataclasses import dataclass, field

import torch

__all__ = ["History", "SamplingParams", "SamplingRequest", "Sampler", "TokenLogprobs", "make_generator",
           "token_logprobs"]

_SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed accepts without wrapping


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How one request picks its next tokens and when it stops."""

    max_new_tokens: int = 16
    """Most tokens to generate; >= 1."""
    temperature: float = 1.0
    """Logits are divided by this; 0 selects greedy decoding (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens (ties at the k-th all kept); 0 turns it off."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 turns it off."""
    seed: int | None = None
    """Seeds the request's own generator; None draws from torch's global generator."""
    stop: list[str] = field(default_factory=list)
    """Generation ends before the first occurrence of any of these strings."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation ends at any of these tokens (in addition to the model's EOS ids)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS ids (stop_token_ids and stop strings still apply);
    benchmarks use it so that every row decodes exactly max_new_tokens."""
    repetition_penalty: float = 1.0
    """> 0; 1 turns it off. Logits of prompt and output tokens: divided (positive) or multiplied
    (negative) by it."""
    presence_penalty: float = 0.0
    """In [-2, 2]; subtracted once from the logit of every token the output already holds."""
    frequency_penalty: float = 0.0
    """In [-2, 2]; subtracted from a token's logit as many times as the output holds it."""
    min_p: float = 0.0
    """In [0, 1]; sampling drops tokens less likely than ``min_p`` times the most likely one."""
    logprobs: int | None = None
    """Return each generated token's log-probability and the ``logprobs`` most likely tokens'
    (0 .. 20; None: none). From the model's float32 logits, before penalties and temperature."""

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or not (0.0 <= self.temperature < float("inf")):
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]):
            raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**64 - 1], got {self.seed!r}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"SamplingParams.stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_number(self.repetition_penalty) or not (0.0 < self.repetition_penalty < float("inf")):
            raise ValueError(f"SamplingParams.repetition_penalty must be a finite number > 0 (1 = off), "
                             f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"SamplingParams.logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether its tokens so far change its logits (a penalty is on)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """What the stage that samples needs of a request when its first step arrives."""

    params: SamplingParams
    prompt_ids: tuple[int, ...] = ()
    """The prompt, when a repetition penalty needs it (else empty)."""

    @classmethod
    def of(cls, params: SamplingParams, prompt_ids: Iterable[int]) -> SamplingRequest:
        return cls(params, tuple(prompt_ids) if params.repetition_penalty != 1.0 else ())


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's log-probability and the most likely tokens' at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token, log-probability) of the ``logprobs`` most likely tokens, most likely first."""


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
            uniforms = _uniforms(len(rows), [generators[i] for i in rows], logits.device)
            out.index_copy_(0, idx, _inverse_cdf(probs, uniforms))
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


def _uniforms(n: int, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row: ``float64 [n]``; seeded rows each from their own generator."""
    u = torch.empty(n, dtype=torch.float64, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, dtype=torch.float64, device=device, generator=g)[0]
    return u


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
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

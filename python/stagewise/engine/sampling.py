"""Per-request sampling settings and the batched token sampler.

The filter chain is the one Hugging Face ``generate`` applies when sampling, in
the same order and with the same arithmetic, so a request sampled here sees the
same candidate set and probabilities as under transformers:

    logits / temperature  ->  top-k  ->  top-p (nucleus, keeps at least 1 token)  ->  draw

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

from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "Sampler", "make_generator"]

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
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    ) -> torch.Tensor:
        """``logits [B, V]`` (any float dtype) -> token ids ``LongTensor [B]``.

        ``params[i]`` and ``generators[i]`` belong to row i; a None generator
        draws from torch's global generator for ``logits.device``.
        """
        _check_batch(logits, params, generators)
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
            return scores  # nothing to filter: skip the sort

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

        return torch.empty_like(scores).scatter_(1, order, sorted_scores)


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

"""Speculative decoding: stage 0 proposes draft tokens, one step verifies them through every stage
and rank, and the last stage accepts them so that the output is exactly the target model's.

**The step.** A running request with drafts ``d_1..d_k`` runs as one row of ``1 + k`` tokens (its
last sampled token, then the drafts) after its cache, a chunk like a prompt's
(:attr:`~stagewise.model.batch.StepBatch.draft_tokens`). Every stage writes the KV of all ``1 + k``
positions; the last stage takes logits at each of them and :func:`~stagewise.engine.verify.verify` accepts a prefix of the
drafts plus one token of its own, so a step yields 1 to ``k + 1`` tokens.

**Exactness.** A drafter here proposes tokens, not distributions: its proposal ``q`` is a point
mass. Draft ``d_j`` is then accepted with probability ``p_j(d_j)`` (``min(1, p/q)`` with ``q = 1``),
and on a rejection the token is drawn from ``p_j`` without ``d_j`` (``max(0, p - q)`` renormalised),
where ``p_j`` is the distribution the sampler draws from at position ``j``: penalties with the
accepted drafts before it counted as output, temperature, top-k, top-p, min-p. Every token is
then distributed exactly as without speculation (Leviathan et al., 2023, with a one-hot draft
distribution). Greedy rows accept while each draft is the argmax, and their tokens are the
non-speculative ones. Log-probabilities are read at each token's own position.

**Rollback.** The accepted count goes back to stage 0 with the tokens (a row of the ``Tokens``
message carries 1 to ``k + 1`` of them). The request's next step then starts at the first position
not accepted: every stage and rank sees a step that continues the request before the KV it holds
ends, and drops the rejected positions' KV (:meth:`~stagewise.kv.KVCacheManager.truncate`) before
it writes (before the step takes any block), by at most the drafts of the request's previous
step, so no stage holds KV the others rolled back. Stage 0's block count
(:meth:`~stagewise.kv.budget.KVBudget.truncate`) shrinks when it schedules that step, never while
a pool still holds the blocks; prefix caching names only accepted positions' blocks.

**Drafters.** :class:`NgramDrafter` (prompt lookup): the continuation of the longest earlier
match of the sequence's last ``n`` tokens, in the prompt and the output so far; a draft model's
greedy continuation (:mod:`stagewise.engine.draft_model`). Whatever proposes implements
:class:`Drafter`; :class:`AdaptiveK` lowers a request's ``k`` (down to 0, with occasional probes)
while its drafts are rejected, so text the drafter cannot predict costs little. This module holds
stage 0's side; the last stage's acceptance is :mod:`stagewise.engine.verify`. A request with
structured output drafts too: the last stage masks each position with its constraint advanced
through the drafts before it, and rolls the constraint back to what was accepted. Not drafted:
models with a sliding window (a window's trimmed blocks cannot be rolled back).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from stagewise.engine.pacing import CostLine
from stagewise.engine.params import SamplingParams

if TYPE_CHECKING:
    from stagewise.engine.scheduler import SeqState

METHODS = ("ngram", "draft")
"""What ``--speculative`` takes: ``ngram``, or ``draft:PATH`` (a draft model)."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How stage 0 drafts: ``method`` and at most ``num_tokens`` drafts per request and step."""

    method: str = "ngram"
    num_tokens: int = 3
    ngram_max: int = 4
    """Longest suffix the n-gram drafter matches."""
    ngram_min: int = 2
    """Shortest; a shorter suffix proposes nothing."""
    draft_model: str | None = None
    """``draft``: the draft model (a folder, a .gguf file or a built-in name) with the target's
    vocabulary (:mod:`stagewise.engine.draft_model`)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if (self.method == "draft") != bool(self.draft_model):
            raise ValueError("speculative: a draft model is given with method 'draft' (draft:PATH), and only then")
        for name, low in (("num_tokens", 1), ("ngram_max", 1), ("ngram_min", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"speculative: {name} must be an int >= {low}, got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"speculative: ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")

    def drafter(self, *, device, max_model_len: int, max_num_seqs: int, vocab_size: int) -> Drafter:
        """The drafter, on stage 0's ``device`` for requests of up to ``max_model_len`` tokens of a
        model of ``vocab_size`` tokens."""
        if self.method == "draft":
            from stagewise.engine.draft_model import DraftModel

            return DraftModel(self.draft_model, device=device, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              vocab_size=vocab_size)
        return NgramDrafter(self.ngram_min, self.ngram_max)

    @classmethod
    def of(cls, method: str | None, num_tokens: int = 3) -> SpeculativeConfig | None:
        """The options of the API, the CLI and a run plan (``speculative``: ``ngram`` or
        ``draft:PATH``; ``num_speculative_tokens``) as a config; None when ``method`` is None."""
        if method is None:
            return None
        name, _, path = method.partition(":")
        return cls(method=name, num_tokens=num_tokens, draft_model=path or None)


class Drafter(Protocol):
    """Proposes draft tokens for running requests, all of a step's at once (a draft model runs
    them as one batch). A drafter sees tokens only (the prompt and the output so far); one that
    reads the target's hidden states (EAGLE, MTP heads) needs them passed back from the last stage,
    which this interface leaves to a later field."""

    def propose(self, requests: Sequence[tuple[Hashable, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """For each ``(request_id, tokens, k)``: up to ``k`` tokens likely to follow ``tokens`` (the
        request's prompt and output so far)."""

    def forget(self, request_id: Hashable) -> None:
        """The request ended: drop what was kept of it."""


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last
    ``n`` tokens, for the longest ``n`` in ``[n_min, n_max]`` that occurred before. Each request
    keeps an index of its n-grams, grown by the tokens added since its last proposal, so a
    proposal costs a few dictionary lookups however long the prompt."""

    def __init__(self, n_min: int = 2, n_max: int = 4) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._index: dict[Hashable, tuple[list[dict[tuple[int, ...], int]], list[int]]] = {}

    def propose(self, requests: Sequence[tuple[Hashable, Sequence[int], int]]) -> list[tuple[int, ...]]:
        return [self.lookup(rid, tokens, k) for rid, tokens, k in requests]

    def lookup(self, request_id: Hashable, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """One request's proposal."""
        if k < 1 or len(tokens) <= self.n_min:
            return ()
        tables, done = self._index.setdefault(request_id, ([{} for _ in range(self.n_max + 1)], [0]))
        end = len(tokens)
        for e in range(max(done[0], self.n_min), end):  # n-grams ending before e, followed by tokens[e]
            for n in range(self.n_min, min(self.n_max, e) + 1):
                tables[n][tuple(tokens[e - n:e])] = e
        done[0] = end
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            at = tables[n].get(tuple(tokens[end - n:]))
            if at is not None:
                return tuple(tokens[at:at + k])
        return ()

    def forget(self, request_id: Hashable) -> None:
        self._index.pop(request_id, None)


@dataclass(slots=True)
class _Rate:
    rate: float = 0.6
    """Accepted / proposed drafts, an exponential average."""
    skip: int = 0
    """Steps left without drafts (backing off)."""
    backoff: int = 1


@dataclass
class AdaptiveK:
    """Each request's draft length from how many of its drafts were accepted: the full ``k`` while
    at least ``keep`` of them are, fewer as the rate falls, none below ``stop``, and none whose
    chance of being accepted does not pay for its share of a step (:meth:`next_k`); after a stop it
    drafts one token again after 1, 2, 4 ... 32 steps to see whether the text became predictable."""

    k: int
    keep: float = 0.5
    stop: float = 0.2
    _rates: dict[Hashable, _Rate] = field(default_factory=dict)

    def next_k(self, request_id: Hashable, share: float = 0.0) -> int:
        """``share``: the part of a step's time that its tokens' number decides, which one more
        token adds in proportion (0: tokens are free, a step costs what reading the weights does;
        near 1: compute-bound). The ``j``-th draft is accepted with a chance of about ``rate ** j``,
        and pays for the time it adds while that is above ``share``."""
        r = self._rates.get(request_id)
        if r is None:
            return self.k
        if r.skip:
            r.skip -= 1
            return 1 if r.skip == 0 else 0
        k = self.k if r.rate >= self.keep else max(1, round(self.k * r.rate / self.keep))
        k = sum(1 for j in range(1, k + 1) if r.rate ** j > max(share, self.stop if j == 1 else 0.0))
        if k == 0:  # not worth a step's time now: look again later
            r.skip, r.backoff = r.backoff, min(2 * r.backoff, 32)
        return k

    def verified(self, request_id: Hashable, proposed: int, accepted: int) -> None:
        if proposed < 1:
            return
        r = self._rates.setdefault(request_id, _Rate())
        r.rate = 0.7 * r.rate + 0.3 * accepted / proposed
        if r.rate < self.stop:
            r.skip, r.backoff = r.backoff, min(2 * r.backoff, 32)
        else:
            r.backoff = 1

    def forget(self, request_id: Hashable) -> None:
        self._rates.pop(request_id, None)


@dataclass(kw_only=True, slots=True)
class SpeculativeStats:
    """Stage 0's count of drafted and accepted tokens since the engine started."""

    proposed: int = 0
    accepted: int = 0


class Speculation:
    """Stage 0's side: the drafts of a group's running requests before their step, and how many of
    them the last stage accepted when its tokens come back."""

    def __init__(self, config: SpeculativeConfig, drafter: Drafter, max_model_len: int) -> None:
        self.config, self.drafter, self.max_model_len = config, drafter, max_model_len
        self.lengths = AdaptiveK(config.num_tokens)
        self.stats = SpeculativeStats()
        self.costs = CostLine(64)
        """Stage 0's decode steps: seconds against tokens (a + b * tokens)."""

    def timed(self, tokens: int, seconds: float) -> None:
        """A decode step of ``tokens`` tokens (drafts included) took ``seconds`` on stage 0."""
        self.costs.add(tokens, seconds)

    def token_share(self, rows: int) -> float:
        """Of a step of ``rows`` decoding rows, the part of its time its tokens' number decides
        (``b * rows / (a + b * rows)`` from the fitted line). 0 until the slope is told apart from
        the timings' noise (at least 3 standard errors, over 8 steps or more): where steps cost
        about the same whatever their tokens, drafts are taken as free, not cut by a chance slope."""
        fit, pts = self.costs.fit(), self.costs.points
        if fit is None or fit[1] <= 0 or len(pts) < 8:
            return 0.0
        a, b = fit
        mx = sum(x for x, _ in pts) / len(pts)
        spread = sum((x - mx) ** 2 for x, _ in pts)
        noise = sum((y - a - b * x) ** 2 for x, y in pts) / (len(pts) - 2)
        if spread <= 0 or b * b * spread < 9 * noise:
            return 0.0
        return b * rows / max(a + b * rows, 1e-12)

    def draft(self, seqs: Iterable[SeqState], params: Callable[[Hashable], SamplingParams]) -> None:
        """Set ``drafts`` of each decoding request: never past its ``max_new_tokens`` or the model's
        length (a step yields at most ``drafts + 1`` tokens)."""
        asked, wanted = [], []
        seqs = list(seqs)
        share = self.token_share(sum(1 for seq in seqs if seq.output_ids))  # the step's decoding rows
        for seq in seqs:
            seq.drafts = ()
            if not seq.output_ids or seq.num_prefilled < len(seq.prompt_ids):
                continue
            p = params(seq.request_id)
            made = len(seq.prompt_ids) + len(seq.output_ids)
            room = min(p.max_new_tokens - len(seq.output_ids), self.max_model_len - made) - 1
            k = min(self.lengths.next_k(seq.request_id, share), room,
                    room if p.max_draft_tokens is None else p.max_draft_tokens)
            if k > 0:
                asked.append(seq)
                wanted.append((seq.request_id, seq.prompt_ids + seq.output_ids, k))
        if asked:
            for seq, drafts in zip(asked, self.drafter.propose(wanted)):
                seq.drafts = tuple(drafts)

    def verified(self, seq: SeqState, tokens: int) -> None:
        """``tokens`` came back for ``seq``'s step (its drafts accepted: ``tokens - 1``)."""
        proposed = len(seq.drafts)
        if proposed:
            accepted = min(tokens - 1, proposed)
            self.lengths.verified(seq.request_id, proposed, accepted)
            seq.proposed, seq.accepted = seq.proposed + proposed, seq.accepted + accepted
            self.stats.proposed += proposed
            self.stats.accepted += accepted
            seq.drafts = ()

    def forget(self, request_id: Hashable) -> None:
        self.drafter.forget(request_id)
        self.lengths.forget(request_id)

"""The requests stage 0 serves, at the level of tokens: prompt checks, the tokens each request has
generated, the stops that tokens decide (EOS and stop token ids, ``max_new_tokens``, the model's
length), and the result when a request ends.

Text is not here: detokenisation and stop strings belong to the front end
(:mod:`stagewise.frontend.text`), so that no stage needs the tokenizer. :class:`Requests` knows
nothing of KV blocks, steps or stages either: the :class:`~stagewise.engine.engine.Engine` hands
it each step's sampled tokens and asks it to close a request, whatever ended it. Whoever streams
takes the new tokens (:meth:`Requests.take_tokens`); nothing here calls back into the caller.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from stagewise.engine.params import SamplingParams, TokenLogprobs
from stagewise.engine.scheduler import SeqState

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(kw_only=True, slots=True)
class RequestOutput:
    """A request that ended: its generated ids (a stop token that ended it included) and why."""

    request_id: Hashable
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    """'stop', 'length', 'cancelled' or 'error'."""
    error: str | None = None
    text: str = ""
    """Its text, when a front end with the tokenizer decoded it (the engine leaves it empty)."""
    logprobs: list[TokenLogprobs] | None = None
    """One entry per generated token when the request asked for ``logprobs``."""
    arrival_s: float = 0.0
    """time.perf_counter() when it was added."""
    first_token_s: float | None = None
    """time.perf_counter() when its first token was sampled (None: it produced none)."""
    finish_s: float = 0.0
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (not computed again)."""
    draft_tokens: int = 0
    """Draft tokens proposed for it (speculative decoding)."""
    accepted_tokens: int = 0
    """Of them, those the last stage accepted."""

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"RequestOutput.finish_reason: expected one of {FINISH_REASONS}, "
                             f"got {self.finish_reason!r}")


@dataclass(kw_only=True, slots=True)
class _Request:
    seq: SeqState
    params: SamplingParams
    stop_ids: frozenset[int]
    logprobs: list[TokenLogprobs] | None
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    resumed: int = 0


def prompt_problem(prompt_ids: Sequence[int], vocab_size: int) -> str | None:
    """What is wrong with a prompt's token ids (None: nothing): none at all, or ids that are not
    ints in ``[0, vocab_size)``. Stage 0 refuses such a request; a server checks it at its door."""
    if not prompt_ids:
        return "the prompt is empty (it needs at least one token)"
    bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        more = " ..." if len(bad) > 8 else ""
        return f"prompt token ids must be ints in [0, vocab_size={vocab_size}), got {bad[:8]}{more}"
    return None


class Requests:
    """Every live request of stage 0, by id."""

    def __init__(self, *, vocab_size: int, eos_token_ids: Sequence[int], max_model_len: int) -> None:
        self.vocab_size, self.eos_token_ids, self.max_model_len = vocab_size, tuple(eos_token_ids), max_model_len
        self._live: dict[Hashable, _Request] = {}
        self._tokens: list[tuple[Hashable, int, TokenLogprobs | None]] = []

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def add(self, request_id: Hashable, prompt_ids: Sequence[int], params: SamplingParams,
            resumed: int = 0) -> SeqState:
        """Check and register a request; returns the state the scheduler tracks. ValueError, with
        nothing registered, for a known id, an empty prompt or ids outside the vocabulary.
        ``resumed``: how many of the prompt's last tokens it generated before a restart."""
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
        ids = list(prompt_ids)
        problem = prompt_problem(ids, self.vocab_size)
        if problem:
            raise ValueError(f"request {request_id!r}: {problem}")
        seq = SeqState(request_id=request_id, prompt_ids=ids)
        eos = () if params.ignore_eos else self.eos_token_ids
        self._live[request_id] = _Request(seq=seq, params=params, stop_ids=frozenset((*params.stop_token_ids, *eos)),
                                          logprobs=[] if params.logprobs is not None else None,
                                          resumed=min(max(int(resumed), 0), len(ids) - 1))
        return seq

    def resumed(self, request_id: Hashable) -> int:
        return self._live[request_id].resumed

    def discard(self, request_id: Hashable) -> None:
        """Forget a request that never ran (the scheduler refused it)."""
        self._live.pop(request_id, None)

    def params(self, request_id: Hashable) -> SamplingParams:
        return self._live[request_id].params

    def first_token_s(self, request_id: Hashable) -> float | None:
        """time.perf_counter() when a live request's first token was recorded (None: not yet)."""
        return self._live[request_id].first_token_s

    def record(self, seqs: Sequence[SeqState], tokens: Sequence[int],
               logprobs: Sequence[TokenLogprobs | None] | None = None,
               counts: Sequence[int] | None = None) -> list[tuple[Hashable, str]]:
        """Append each request's sampled tokens (``counts[i]`` for ``seqs[i]``, request after request:
        one, or the accepted drafts and one more after a speculative step; None: one each;
        ``logprobs`` beside them where asked) and return ``(request_id, finish_reason)`` of those
        that end with them: 'stop' at a stop token, 'length' at ``max_new_tokens`` or the model's
        length; a request's tokens after the one that ends it are dropped. Requests that ended
        meanwhile are skipped."""
        ended, now, end = [], time.perf_counter(), 0
        counts = [1] * len(seqs) if counts is None else counts
        if len(counts) != len(seqs) or sum(counts) != len(tokens):
            raise ValueError(f"Requests.record: {len(tokens)} tokens in {list(counts)[:8]} for {len(seqs)} requests")
        for seq, n in zip(seqs, counts):
            start, end = end, end + n
            req = self._live.get(seq.request_id)
            if req is None:
                continue
            if req.first_token_s is None:
                req.first_token_s = now
            for i, token in enumerate(tokens[start:end], start):
                lp = None if logprobs is None else logprobs[i]
                seq.output_ids.append(token)
                if req.logprobs is not None:
                    req.logprobs.append(lp)
                self._tokens.append((seq.request_id, token, lp))
                if token in req.stop_ids:
                    ended.append((seq.request_id, "stop"))
                    break
                if (len(seq.output_ids) >= req.params.max_new_tokens
                        or len(seq.prompt_ids) + len(seq.output_ids) >= self.max_model_len):
                    ended.append((seq.request_id, "length"))  # max_model_len bounds prompt + generated tokens
                    break
        return ended

    def take_tokens(self) -> list[tuple[Hashable, int, TokenLogprobs | None]]:
        """(request_id, token, its logprobs or None) of every token recorded since the last call,
        in order: what a front end streams."""
        out, self._tokens = self._tokens, []
        return out

    def finish(self, request_id: Hashable, reason: str, error: str | None = None) -> RequestOutput:
        """Close a request and return its result. KeyError for an id that is not live."""
        req = self._live.pop(request_id)
        seq = req.seq
        return RequestOutput(request_id=request_id, prompt_ids=seq.prompt_ids, token_ids=list(seq.output_ids),
                             finish_reason=reason, error=error, logprobs=req.logprobs, arrival_s=req.arrival_s,
                             first_token_s=req.first_token_s, finish_s=time.perf_counter(),
                             cached_tokens=seq.cached_tokens, draft_tokens=seq.proposed,
                             accepted_tokens=seq.accepted)

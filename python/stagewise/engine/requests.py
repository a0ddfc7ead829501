"""The text side of the requests stage 0 serves: prompt checks, the tokens each request has
generated, detokenisation, stop rules, the text deltas to stream and the result when a request
ends.

:class:`Requests` knows nothing of KV blocks, steps or stages: the
:class:`~stagewise.engine.engine.Engine` hands it each step's sampled tokens and asks it to
close a request, whatever ended it. Whoever streams text takes the deltas
(:meth:`Requests.take_text`); nothing here calls back into the caller.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from stagewise.engine.detokenize import IncrementalDetokenizer, StopChecker
from stagewise.engine.sampling import SamplingParams
from stagewise.engine.scheduler import SeqState

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(kw_only=True, slots=True)
class RequestOutput:
    """A request that ended: its generated ids (the stop token included), text and why it ended."""

    request_id: Hashable
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    """'stop', 'length', 'cancelled' or 'error'."""
    error: str | None = None
    arrival_s: float = 0.0
    """time.perf_counter() when it was added."""
    first_token_s: float | None = None
    """time.perf_counter() when its first token was sampled (None: it produced none)."""
    finish_s: float = 0.0

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"RequestOutput.finish_reason: expected one of {FINISH_REASONS}, "
                             f"got {self.finish_reason!r}")


@dataclass(kw_only=True, slots=True)
class _Request:
    seq: SeqState
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    stop: StopChecker
    text: list[str] = field(default_factory=list)
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None


class Requests:
    """Every live request of stage 0, by id."""

    def __init__(self, *, vocab_size: int, eos_token_ids: Sequence[int], max_model_len: int,
                 tokenizer=None) -> None:
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)
        self.max_model_len, self.tokenizer = max_model_len, tokenizer
        self._live: dict[Hashable, _Request] = {}
        self._first_tokens: list[Hashable] = []
        self._deltas: list[tuple[Hashable, str]] = []

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def add(self, request_id: Hashable, prompt_ids: Sequence[int], params: SamplingParams) -> SeqState:
        """Check and register a request; returns the state the scheduler tracks. ValueError, with
        nothing registered, for a known id, an empty prompt, ids outside the vocabulary or stop
        strings without a tokenizer."""
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
        ids = list(prompt_ids)
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty (it needs at least one token)")
        vocab = self.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: prompt token ids must be ints in [0, vocab_size={vocab}), "
                             f"got {bad[:8]}{' ...' if len(bad) > 8 else ''}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer; this model has none")
        seq = SeqState(request_id=request_id, prompt_ids=ids)
        detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, ids)
        eos = () if params.ignore_eos else self.eos_token_ids
        self._live[request_id] = _Request(seq=seq, params=params, detok=detok,
                                          stop=StopChecker(params.stop, params.stop_token_ids, eos))
        return seq

    def discard(self, request_id: Hashable) -> None:
        """Forget a request that never ran (the scheduler refused it)."""
        self._live.pop(request_id, None)

    def params(self, request_id: Hashable) -> SamplingParams:
        return self._live[request_id].params

    def record(self, seqs: Iterable[SeqState], tokens: Iterable[int]) -> list[tuple[Hashable, str]]:
        """Append each request's sampled token (one per seq, in order) and return
        ``(request_id, finish_reason)`` of those that end with it. Requests that ended meanwhile
        are skipped."""
        ended, now = [], time.perf_counter()
        for seq, token in zip(seqs, tokens, strict=True):
            req = self._live.get(seq.request_id)
            if req is not None and (reason := self._append(req, token, now)) is not None:
                ended.append((seq.request_id, reason))
        return ended

    def take_text(self) -> list[tuple[Hashable, str]]:
        """(request_id, text delta) in the order the text grew, since the last call."""
        out, self._deltas = self._deltas, []
        return out

    def take_first_tokens(self) -> list[Hashable]:
        """Requests whose first token was recorded since the last call."""
        out, self._first_tokens = self._first_tokens, []
        return out

    def finish(self, request_id: Hashable, reason: str, error: str | None = None) -> RequestOutput:
        """Close a request: the text held back is released for cancel and error, and its result
        returned. KeyError for an id that is not live."""
        req = self._live.pop(request_id)
        if reason in ("cancelled", "error"):
            self._emit(req, self._finish_text(req)[0])  # text held back for a possible stop string
        seq = req.seq
        return RequestOutput(request_id=request_id, prompt_ids=seq.prompt_ids, token_ids=list(seq.output_ids),
                             text="".join(req.text), finish_reason=reason, error=error, arrival_s=req.arrival_s,
                             first_token_s=req.first_token_s, finish_s=time.perf_counter())

    def _append(self, req: _Request, token: int, now: float) -> str | None:
        """Record one sampled token; returns the finish reason if the request ends with it."""
        seq, params = req.seq, req.params
        seq.output_ids.append(token)
        if req.first_token_s is None:
            req.first_token_s = now
            self._first_tokens.append(seq.request_id)
        if req.stop.is_stop_token(token):  # EOS / stop ids: their own text is not shown
            self._emit(req, self._finish_text(req)[0])
            return "stop"
        piece = req.detok.push(token) if req.detok is not None else ""
        text, reason = req.stop.feed(piece)
        # max_model_len bounds prompt + generated tokens.
        out_of_room = (len(seq.output_ids) >= params.max_new_tokens
                       or len(seq.prompt_ids) + len(seq.output_ids) >= self.max_model_len)
        if reason is None and out_of_room:
            tail, reason = self._finish_text(req)
            text, reason = text + tail, reason or "length"
        self._emit(req, text)
        return reason

    @staticmethod
    def _finish_text(req: _Request) -> tuple[str, str | None]:
        """The text held back (detokenizer tail, possible stop-string prefix), and 'stop' if a
        stop string completes in it."""
        return req.stop.finish(req.detok.flush() if req.detok is not None else "")

    def _emit(self, req: _Request, text: str) -> None:
        if text:
            req.text.append(text)
            self._deltas.append((req.seq.request_id, text))

"""The front end's side of generation: the text of each request's token stream.

The engine works in tokens; whoever holds the tokenizer (the process that serves the user: the
API, the CLI) turns each request's tokens into text as they arrive, with the incremental
detokeniser, and applies its stop strings. A stop string can end a request in the middle of its
stream: :meth:`TextStreams.feed` says so, and the caller then cancels the request in the engine
(it may have sampled a token or two more meanwhile, which are dropped) and reports it as ended
with 'stop', its tokens up to the one that completed the stop string.

Per request and token::

    delta, stopped = streams.feed(rid, token)     # EOS / stop ids: no text of their own
    ... when the engine ends the request (stop token, length, cancel, error):
    closed = streams.close(rid, reason)           # a stop string may still complete in the tail
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from stagewise.frontend.detokenize import IncrementalDetokenizer, StopChecker
from stagewise.engine import constraints
from stagewise.engine.params import SamplingParams


def request_problem(params: SamplingParams, checkpoint, tokenizer) -> str | None:
    """What keeps a request from running that the front end tells before it is added: stop
    strings or a constraint without a tokenizer, a constraint that does not compile (None: it
    can run). ``checkpoint``'s tokenizer is ``tokenizer`` (None: it has none)."""
    if params.stop and tokenizer is None:
        return "stop strings need a tokenizer; this checkpoint has none"
    if not params.constrained:
        return None
    return constraints.problem(params, None if tokenizer is None else _vocabulary(checkpoint, tokenizer))


def warm_constraints(checkpoint, tokenizer) -> None:
    """Build the vocabulary that constraints are compiled against now (~0.4 s for SmolLM2's 49k
    tokens), so that the first constrained request does not wait for it: a server calls this on
    a worker thread when it starts. The last stage's leader shares it in the same process. A
    tokenizer the engine cannot read is left for the first constrained request, which names it."""
    if checkpoint is None or tokenizer is None:
        return
    try:
        _vocabulary(checkpoint, tokenizer).ll
    except Exception:  # noqa: BLE001 - told to the request that needs it
        pass


def _vocabulary(checkpoint, tokenizer) -> constraints.Vocabulary:
    cfg = checkpoint.config
    return constraints.vocabulary(("checkpoint", str(checkpoint.path)), lambda: tokenizer, cfg.vocab_size,
                                  cfg.eos_token_ids)


@dataclass(frozen=True, slots=True)
class Closed:
    """A request's text when it ended."""

    text: str
    """All of it."""
    tail: str
    """What :meth:`TextStreams.close` released: the text held back until the end."""
    finish_reason: str
    tokens: list[int]
    """Its tokens, up to the one that completed a stop string."""


@dataclass(slots=True)
class _Stream:
    detok: IncrementalDetokenizer | None
    stop: StopChecker
    tokens: list[int]
    text: list[str]
    stopped: bool = False


class TextStreams:
    """The text of every open request, by id. Without a tokenizer every text is empty (token
    ids in and out), and stop strings cannot be asked for."""

    def __init__(self, tokenizer=None, eos_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, tuple(eos_token_ids)
        self._open: dict[Hashable, _Stream] = {}

    def open(self, request_id: Hashable, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer; this model has none")
        detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, prompt_ids)
        eos = () if params.ignore_eos else self.eos_token_ids
        self._open[request_id] = _Stream(detok=detok, stop=StopChecker(params.stop, params.stop_token_ids, eos),
                                         tokens=[], text=[])

    def feed(self, request_id: Hashable, token: int) -> tuple[str, bool]:
        """A new token of an open request: (the text it adds, True when a stop string completed
        with it: the request ends here)."""
        s = self._open[request_id]
        if s.stopped:
            return "", True
        s.tokens.append(token)
        if s.stop.is_stop_token(token):  # its own text is not shown; the engine ends the request
            return "", False
        text, reason = s.stop.feed(s.detok.push(token) if s.detok is not None else "")
        s.text.append(text)
        s.stopped = reason is not None
        return text, s.stopped

    def close(self, request_id: Hashable, reason: str) -> Closed:
        """End a request: its text (the text held back released) and its final finish reason:
        'stop' when a stop string completed earlier, or completes in the text held back of a
        request that ran out of length; else ``reason``."""
        s = self._open.pop(request_id)
        if s.stopped:
            return Closed(text="".join(s.text), tail="", finish_reason="stop", tokens=s.tokens)
        tail, stopped = s.stop.finish(s.detok.flush() if s.detok is not None else "")
        s.text.append(tail)
        final = "stop" if stopped and reason == "length" else reason
        return Closed(text="".join(s.text), tail=tail, finish_reason=final, tokens=s.tokens)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._open

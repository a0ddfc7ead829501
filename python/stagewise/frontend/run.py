"""A run: requests handed to a :class:`Backend` — the single-process engine
(:class:`~stagewise.frontend.local.LocalBackend`), a pipeline's driver
(:class:`~stagewise.pipeline.driver.PipelineDriver`) or a driver that repairs its pipeline
(:class:`~stagewise.pipeline.recovery.Recovering`) — and their tokens turned into text, streamed,
and collected into results and timings.

The backends work in tokens; the text (incremental detokenisation, stop strings) is made here,
where the tokenizer is (:class:`~stagewise.frontend.text.TextStreams`). A stop string that
completes ends the request here at once; the backend is told to cancel it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from stagewise.engine.params import SAMPLING_FIELDS, SamplingParams, TokenLogprobs, unknown_field
from stagewise.engine.requests import FINISH_REASONS, RequestOutput
from stagewise.frontend.text import Closed, TextStreams

if TYPE_CHECKING:
    from stagewise.engine.images import ImageInputs


@runtime_checkable
class Backend(Protocol):
    """What a :class:`Run` drives. Every request added ends with exactly one output from
    :meth:`poll`, a cancelled or aborted one included; by then its tokens wait in
    :meth:`take_tokens`."""

    def add(self, request_id: int, prompt_ids: list[int], params: SamplingParams,
            images: ImageInputs | None = None) -> None:
        """Start a request; ValueError, with nothing started, for one it refuses (its prompt)."""

    def cancel(self, request_id: int) -> None:
        """End a request (finish_reason 'cancelled'); an unknown or ended one is ignored."""

    def abort(self, request_id: int, error: str) -> None:
        """End a request with finish_reason 'error' and ``error``."""

    def poll(self, timeout: float) -> list[RequestOutput]:
        """Run or wait up to ``timeout`` seconds; the requests that ended."""

    def take_tokens(self) -> list[tuple[int, int, TokenLogprobs | None]]:
        """(request id, token, its logprobs or None) of every token since the last call, in order."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (stage 0's index; requests running go on)."""

    def close(self) -> None:
        """Let go of what it holds (the engine, or the stage processes); it takes nothing more."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Completion:
    """The result of one prompt."""

    text: str
    """Generated text (stop strings and stop tokens not included)."""
    token_ids: list[int]
    """Generated token ids only (a stop token that ended generation included; with a stop string,
    up to the token that completed it)."""
    finish_reason: str
    """'stop' (EOS, stop token or stop string), 'length', 'cancelled' or 'error'."""
    error: str | None = None
    """What went wrong when finish_reason is 'error' (the tokens generated before are kept)."""
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    """With ``logprobs=K``: one entry per generated token."""
    cached_tokens: int = 0
    """Prompt tokens whose KV the prefix cache held (not computed again)."""
    draft_tokens: int = 0
    """Draft tokens proposed for it (speculative decoding)."""
    accepted_tokens: int = 0
    """Of them, those the last stage accepted."""

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Completion.finish_reason: expected one of {FINISH_REASONS}, got {self.finish_reason!r}")


def sampling_per_prompt(base: Mapping[str, Any], n: int,
                        overrides: Sequence[Mapping[str, Any] | None] | None) -> list[SamplingParams]:
    """Each prompt's :class:`SamplingParams`: ``base`` (a call's sampling keywords; the fields not
    named keep their defaults) with ``overrides[i]``'s fields replaced, and with a ``seed`` given,
    prompt i seeded ``seed + i`` unless its override names a seed. ValueError naming the prompt and
    field for anything wrong."""
    if overrides is not None and len(overrides) != n:
        raise ValueError(f"Pipeline.generate: overrides must hold one entry per prompt ({n}), got {len(overrides)}")
    for name in base:
        if name not in SAMPLING_FIELDS:
            raise ValueError(f"Pipeline.generate: {unknown_field(name)}")
    SamplingParams(**base)  # the call's own values, checked as given (a seed before it is offset)
    out = []
    for i in range(n):
        fields = dict(base)
        if fields.get("seed") is not None:
            fields["seed"] = (fields["seed"] + i) % 2**64
        extra = (overrides or [None] * n)[i] or {}
        for name in extra:
            if name not in SAMPLING_FIELDS:
                raise ValueError(f"Pipeline.generate: prompt {i}: {unknown_field(name)}")
        fields.update(extra)
        try:
            out.append(SamplingParams(**fields))
        except ValueError as err:
            raise ValueError(f"Pipeline.generate: prompt {i}: {err}" if overrides else str(err)) from None
    return out


class Run:
    """Requests on a backend, from added to their results: one generate call's (:meth:`wait`), or
    a server's for as long as it runs (:meth:`poll_once` in a loop, ``on_done`` handing each
    result out, :meth:`forget` dropping what is kept of it)."""

    def __init__(self, backend: Backend, streams: TextStreams, on_text: Callable[[int, str], None] | None,
                 on_done: Callable[[int, Completion], None] | None = None) -> None:
        self.backend, self.streams, self.on_text, self.on_done = backend, streams, on_text, on_done
        self.start = time.perf_counter()
        self._held_from = getattr(backend, "constraint_s", None)
        """The engine's structured-output seconds at the start, when it runs in this process (a
        pipeline's stages report theirs: ``Pipeline.stage_stats``)."""
        self.results: dict[int, Completion] = {}
        """prompt index -> its result."""
        self._index: dict[int, int] = {}
        self._prompts: dict[int, list[int]] = {}
        self._logprobs: dict[int, list[TokenLogprobs | None]] = {}
        self._first: dict[int, float] = {}
        self._ended: dict[int, tuple[int, float | None]] = {}
        """request id -> (tokens, first token time) of the requests that ended."""
        self._draft_tokens = self._accepted_tokens = 0
        """Draft tokens proposed for the requests that ended, and those accepted (speculative decoding)."""
        self._pending: set[int] = set()
        """Requests whose output the backend has not given yet (a stop string's cancel too): a
        call returns when none is left, so that nothing of it is left on the backend."""
        self._quiet: set[int] = set()
        """Requests whose consumer raised: no more text is handed to it."""
        self._stopping: dict[int, Closed] = {}
        """Requests a stop string ended, until the backend reports them (with their cached tokens)."""

    def add(self, request_id: int, index: int, prompt_ids: list[int], params: SamplingParams,
            images: ImageInputs | None = None) -> None:
        """Start a request for prompt ``index`` (with its images, if any); a request the backend
        refuses ends at once with its error."""
        try:
            if images is None:
                self.backend.add(request_id, prompt_ids, params)  # checks the prompt's ids first
            else:
                self.backend.add(request_id, prompt_ids, params, images)
        except ValueError as err:
            self._complete(index, prompt_ids, [], "", "error", str(err), None)
            return
        self.streams.open(request_id, prompt_ids, params)
        self._index[request_id], self._prompts[request_id] = index, prompt_ids
        self._pending.add(request_id)
        if params.logprobs is not None:
            self._logprobs[request_id] = []

    @property
    def pending(self) -> int:
        """Requests the backend still holds."""
        return len(self._pending)

    def reject(self, index: int, prompt_ids: list[int], error: str) -> None:
        """Prompt ``index`` ends before it starts, with ``error`` (e.g. an image that cannot be read)."""
        self._complete(index, prompt_ids, [], "", "error", error, None)

    def wait(self) -> None:
        """Until every request ended and the backend reported each."""
        while self._pending:
            self.poll_once(0.05)

    def poll_once(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the backend; hand out the new text and the results."""
        outputs = self.backend.poll(timeout)
        for rid, token, lp in self.backend.take_tokens():
            if rid in self.streams:
                self._token(rid, token, lp)
        for out in outputs:
            self._pending.discard(out.request_id)
            closed = self._stopping.pop(out.request_id, None)
            if closed is not None:  # a stop string ended it: its text and tokens up to there
                self._done(out.request_id, closed, closed.tokens, None, out)
            elif out.request_id in self.streams:
                self._finish(out.request_id, out.finish_reason, out)

    def logprobs(self, request_id: int) -> list[TokenLogprobs | None]:
        """The log-probabilities of a request's tokens so far (``logprobs=K`` requests)."""
        return self._logprobs.get(request_id, [])

    def first_token_s(self, request_id: int) -> float | None:
        return self._first.get(request_id)

    def forget(self, request_id: int) -> bool:
        """Drop what is kept of an ended request (its result was handed out); a server calls this
        so that its memory does not grow with the requests it served. False while the backend
        still holds it (a stop string's cancel on its way)."""
        if request_id in self._pending or request_id in self.streams:
            return False
        index = self._index.pop(request_id, None)
        for d in (self._prompts, self._logprobs, self._first, self._ended):
            d.pop(request_id, None)
        self._quiet.discard(request_id)
        if index is not None:
            self.results.pop(index, None)
        return True

    def cancel(self, request_id: int) -> None:
        """End a request (finish_reason 'cancelled'); its KV is freed on every stage."""
        if request_id in self._pending:
            self.backend.cancel(request_id)

    def _token(self, rid: int, token: int, lp: TokenLogprobs | None) -> None:
        self._first.setdefault(rid, time.perf_counter())
        if rid in self._logprobs:
            self._logprobs[rid].append(lp)
        delta, stopped = self.streams.feed(rid, token)
        self._hand_out(rid, delta)
        if stopped:
            self._stopping[rid] = self._close(rid, "stop")
            self.backend.cancel(rid)

    def _hand_out(self, rid: int, text: str) -> None:
        if not text or self.on_text is None or rid in self._quiet:
            return
        try:
            self.on_text(self._index[rid], text)
        except Exception as err:  # noqa: BLE001 - its consumer is gone: that request ends, the others go on
            self._quiet.add(rid)
            self.backend.abort(rid, f"{type(err).__name__}: {err}")

    def _finish(self, rid: int, reason: str, out: RequestOutput) -> None:
        self._done(rid, self._close(rid, reason), out.token_ids, out.error, out)

    def _close(self, rid: int, reason: str) -> Closed:
        closed = self.streams.close(rid, reason)
        self._hand_out(rid, closed.tail)
        return closed

    def _done(self, rid: int, closed: Closed, tokens: list[int], error: str | None, out: RequestOutput) -> None:
        logprobs = self._logprobs.get(rid)
        self._ended[rid] = (len(tokens), self._first.get(rid))
        self._draft_tokens += out.draft_tokens
        self._accepted_tokens += min(out.accepted_tokens, max(len(tokens) - 1, 0))
        self._complete(self._index[rid], self._prompts[rid], tokens, closed.text, closed.finish_reason,
                       error, None if logprobs is None else logprobs[: len(tokens)], out)

    def _complete(self, index: int, prompt_ids, tokens, text, reason, error, logprobs,
                  out: RequestOutput | None = None) -> None:
        counts = {} if out is None else dict(cached_tokens=out.cached_tokens, draft_tokens=out.draft_tokens,
                                             accepted_tokens=out.accepted_tokens)
        result = Completion(text=text, token_ids=list(tokens), finish_reason=reason, error=error,
                            prompt_token_ids=list(prompt_ids), logprobs=logprobs, **counts)
        self.results[index] = result
        if self.on_done is not None:
            self.on_done(index, result)

    def cancel_unfinished(self) -> None:
        for rid in list(self._pending):
            try:
                self.backend.cancel(rid)
            except Exception:  # noqa: BLE001 - a broken pipeline has nothing left to cancel
                pass

    def stats(self) -> dict[str, Any]:
        """Timings of the call; decode time runs from the first token to the end. With the engine
        in this process, also ``constraint_s``: its steps' time on structured output."""
        end = time.perf_counter()
        firsts = [f for _, f in self._ended.values() if f is not None]
        first = min(firsts, default=end)
        decode_tokens = sum(max(n - 1, 0) for n, _ in self._ended.values())
        decode_s = end - first
        prefill = sum(len(self._prompts[rid]) for rid, (_, f) in self._ended.items() if f is not None)
        out = {"wall_s": end - self.start, "prefill_tokens": prefill, "decode_tokens": decode_tokens,
               "ttft_s": first - self.start,
               "mean_ttft_s": sum(f - self.start for f in firsts) / len(firsts) if firsts else 0.0,
               "decode_s": decode_s,
               "decode_tokens_per_s": decode_tokens / decode_s if decode_tokens and decode_s > 0 else 0.0}
        drafted, accepted = self._draft_tokens, self._accepted_tokens
        if drafted:  # speculative decoding: each decode step gave one token and the drafts it accepted
            out.update(draft_tokens=drafted, accepted_tokens=accepted, acceptance=accepted / drafted,
                       tokens_per_step=decode_tokens / max(decode_tokens - accepted, 1))
        if self._held_from is not None:  # inside the steps: masks, applying them, advancing constraints
            out["constraint_s"] = self.backend.constraint_s - self._held_from
        return out

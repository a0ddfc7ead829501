"""Requests that outlive a stage (:class:`Recovering`): when a stage process dies or hangs, the
pipeline is started again and every request that was running goes on from where it was, its
prompt and the tokens it had generated prefilled anew.

It wraps the driver and answers the same calls (add, cancel, abort, poll, take_tokens), keeping
each running request's prompt, sampling parameters and tokens so far. When the driver reports the
pipeline broken, the requests it failed for that reason are not handed on: ``restart(old driver)``
gives a new driver (:class:`stagewise.launch.start.Restart`: only the lost stages started again
when the others can rejoin, every KV block of every stage dropped; else every stage anew) and each
request is added to it again with its prompt plus the tokens it had, asking for the tokens it
still lacks. The caller sees a delay, then the rest of the tokens, under the same request id; the
result holds every token.

Greedy decoding (and repetition penalties, which count prompt and output alike) give exactly the
tokens of an undisturbed run. A seeded sampler restarts from its seed, and presence / frequency
penalties count only the tokens generated after the restart: their tokens after it may differ.
After ``max_restarts`` restarts a failure ends the requests with the error, as without recovery.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stagewise.engine.params import SamplingParams, TokenLogprobs
from stagewise.engine.requests import RequestOutput
from stagewise.pipeline.faults import PipelineBroken


@dataclass(slots=True)
class _Running:
    prompt_ids: list[int]
    params: SamplingParams
    images: object = None
    """The request's images (a resumed prompt still holds their placeholders)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    carried: int = 0
    """Tokens generated before the latest restart (the current driver's request lacks them)."""
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None


class Recovering:
    """A driver whose pipeline is started again (``restart(broken driver) -> driver``) up to
    ``max_restarts`` times when it breaks, its running requests resumed; a front end's
    :class:`~stagewise.frontend.run.Backend`, as the driver is. ``log`` hears of each restart."""

    def __init__(self, driver, restart: Callable[[object], object], max_restarts: int,
                 log: Callable[[str], None] | None = None) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.driver, self._restart, self.max_restarts, self._log = driver, restart, max_restarts, log
        self.restarts = 0
        self.recovering = False
        """True while a new pipeline starts (the failure is being repaired, not final)."""
        self._running: dict[int, _Running] = {}
        self._tokens: list[tuple[int, int, TokenLogprobs | None]] = []
        self._held: list[RequestOutput] = []
        """Results of requests that ended while a call other than poll repaired the pipeline."""

    # the driver's attributes the front end reads
    @property
    def broken(self) -> str | None:
        """Why the pipeline cannot serve (None while it serves, is being started again, or will be
        on the next call: restarts are left)."""
        if self.recovering or (self.driver.broken and self.restarts < self.max_restarts):
            return None
        return self.driver.broken

    @property
    def repairing(self) -> str | None:
        """Why the pipeline is being started again: a stage died or hung and a restart is under
        way, or due at the next :meth:`poll` (None while it serves, or once it failed for good)."""
        broken = self.driver.broken
        if broken and (self.recovering or self.restarts < self.max_restarts):
            return broken
        return None

    @property
    def status(self) -> dict:
        return self.driver.status

    def stage_stats(self, **kw):
        """Every stage's measurements; a pipeline found broken here (between requests, or while a
        server asks) is repaired first, while restarts are left."""
        return self._repairing(lambda: self.driver.stage_stats(**kw))

    def add(self, request_id: int, prompt_ids: list[int], params: SamplingParams, images=None) -> None:
        self._repairing(lambda: self.driver.add(request_id, prompt_ids, params, images))
        self._running[request_id] = _Running(list(prompt_ids), params, images)

    def _repairing(self, call):
        """``call()`` on the driver; a pipeline broken before or during it is repaired (by
        :meth:`poll`, whose results wait for the next poll) and the call made again."""
        for attempt in range(2):
            if self.driver.broken and self.restarts < self.max_restarts:
                self._held += self.poll(0.0)
            try:
                return call()
            except PipelineBroken:
                if attempt or self.restarts >= self.max_restarts:
                    raise

    def cancel(self, request_id: int) -> None:
        self.driver.cancel(request_id)

    def abort(self, request_id: int, error: str) -> None:
        self.driver.abort(request_id, error)

    def reset_prefix_cache(self) -> None:
        self.driver.reset_prefix_cache()

    def take_tokens(self) -> list[tuple[int, int, TokenLogprobs | None]]:
        out, self._tokens = self._tokens, []
        return out

    def poll(self, timeout: float) -> list[RequestOutput]:
        held, self._held = self._held, []
        outputs = held + self.driver.poll(0.0 if held else timeout)
        self._collect()
        broken = self.driver.broken
        done = []
        resume = []
        for out in outputs:
            req = self._running.get(out.request_id)
            if req is None:
                done.append(out)
            elif broken and out.finish_reason == "error" and self.restarts < self.max_restarts \
                    and out.error == f"pipeline failed: {broken}":
                resume.append(out.request_id)
            else:
                done.append(self._whole(out, req))
        if broken and self.restarts < self.max_restarts:
            done += self._recover(broken, resume)
        elif broken:
            self.driver.close(force=True)  # final: no process is left waiting to rejoin
        return done

    def close(self) -> None:
        self.driver.close()

    # ---- inside ------------------------------------------------------------------------------

    def _collect(self) -> None:
        for rid, token, lp in self.driver.take_tokens():
            req = self._running.get(rid)
            if req is not None:
                req.tokens.append(token)
                req.logprobs.append(lp)
                if req.first_token_s is None:
                    req.first_token_s = time.perf_counter()
            self._tokens.append((rid, token, lp))

    def _whole(self, out: RequestOutput, req: _Running) -> RequestOutput:
        """A request's output with the tokens it had before the restarts."""
        del self._running[out.request_id]
        if not req.carried:
            return out
        logprobs = None if out.logprobs is None else req.logprobs[: req.carried] + list(out.logprobs)
        return dataclasses.replace(out, prompt_ids=req.prompt_ids, token_ids=req.tokens[: req.carried] + out.token_ids,
                                   logprobs=logprobs, arrival_s=req.arrival_s,
                                   first_token_s=req.first_token_s or out.first_token_s)

    def _recover(self, reason: str, resume: list[int]) -> list[RequestOutput]:
        """A new pipeline, the requests in ``resume`` added to it again; what cannot go on ends."""
        self.restarts += 1
        if self._log is not None:
            self._log(f"the pipeline failed ({reason}); starting it again (restart {self.restarts} of "
                      f"{self.max_restarts}), {len(resume)} requests resume")
        self.recovering = True
        try:
            self.driver = self._restart(self.driver)
        except Exception as err:  # noqa: BLE001 - the requests end with why the pipeline could not come back
            self.restarts = self.max_restarts
            self.driver.broken = f"{reason}; starting the pipeline again failed: {err}"
            return [self._failed(rid, self.driver.broken) for rid in resume]
        finally:
            self.recovering = False
        ended = []
        for rid in resume:
            req = self._running[rid]
            left = req.params.max_new_tokens - len(req.tokens)
            if left <= 0:
                ended.append(self._finished(rid, "length"))
                continue
            req.carried = len(req.tokens)
            self.driver.add(rid, req.prompt_ids + req.tokens, dataclasses.replace(req.params, max_new_tokens=left),
                            req.images, resumed=len(req.tokens))
        return ended

    def _finished(self, rid: int, reason: str, error: str | None = None) -> RequestOutput:
        req = self._running.pop(rid)
        return RequestOutput(request_id=rid, prompt_ids=req.prompt_ids, token_ids=list(req.tokens),
                             finish_reason=reason, error=error,
                             logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
                             arrival_s=req.arrival_s, first_token_s=req.first_token_s, finish_s=time.perf_counter())

    def _failed(self, rid: int, error: str) -> RequestOutput:
        return self._finished(rid, "error", f"pipeline failed: {error}")

"""Stage 0 of a pipeline without its IO: requests from the driver, steps to stage 1, tokens back
from the last stage, events for the driver.

The :class:`Head` wraps the :class:`~stagewise.engine.engine.Engine` whose executor holds stage
0's layers. Its process feeds it the driver's messages and the frames of the feedback link, and
sends what it returns: frames for stage 1 (a request's KV is freed downstream before any step
that may reuse its blocks) and messages for the driver.
"""

from __future__ import annotations

import time

from stagewise.engine.engine import Engine
from stagewise.engine.requests import RequestOutput
from stagewise.pipeline import protocol
from stagewise.pipeline.messages import Add, Cancel, Events, Result, Status
from stagewise.pipeline.protocol import Free, Step, StepFailed, Tokens
from stagewise.pipeline.stats import StageStats
from stagewise.transport.frame import Frame


class Head:
    """Stage 0's serving logic over one engine."""

    def __init__(self, engine: Engine, *, stats: StageStats | None = None) -> None:
        if engine.executor.is_last:
            raise ValueError("Head: the engine holds every layer; a single process runs Engine.step()")
        self.engine = engine
        self.stats = stats if stats is not None else StageStats()
        self._events = Events()
        self._last_status: tuple | None = None

    @property
    def busy(self) -> bool:
        """A step is in flight or a request waits to run."""
        return bool(self.engine.inflight) or self.engine.has_unfinished()

    def on_message(self, msg: Add | Cancel) -> None:
        """A request to add or cancel; problems become that request's error result."""
        if isinstance(msg, Add):
            try:
                self.engine.add_request(msg.request_id, msg.prompt_ids, msg.params)
            except (ValueError, TypeError) as err:
                self._events.done.append(Result(request_id=msg.request_id, token_ids=[], text="",
                                                finish_reason="error", error=str(err)))
        elif isinstance(msg, Cancel):  # the request ends at once; its KV is freed on every stage
            out = self.engine.cancel(msg.request_id)
            if out is not None:
                self._finished([out])
        else:
            raise TypeError(f"Head.on_message: expected Add or Cancel, got {type(msg).__name__}")

    def launch(self) -> list[Frame]:
        """Every idle group with work: schedule it, run stage 0's layers. Returns the frames for
        stage 1 in order: frees before the steps that may reuse the freed blocks."""
        out: list[Frame] = []
        for group in self.engine.idle_groups_with_work():
            start = time.perf_counter()
            launched, done = self.engine.launch(group)
            end = time.perf_counter()
            self._finished(done)
            out += self._frees()
            if launched is not None:
                self.stats.computed(start, end, launched.batch.num_tokens, group)
                step = Step(step_id=launched.step_id, group=group,
                            batch=launched.batch.for_next_stage(launched.output),
                            sampling=protocol.encode_sampling(launched.sampling))
                out.append(protocol.to_frame(step, stage_from=0, stage_to=1))
        return out + self._frees()

    def on_feedback(self, msg: Tokens | StepFailed) -> list[Frame]:
        """The last stage's answer to a step; returns frames for stage 1 (frees)."""
        if isinstance(msg, Tokens):
            self._finished(self.engine.complete(msg.group, msg.step_id, msg.request_ids, msg.tokens))
        elif isinstance(msg, StepFailed):
            self._finished(self.engine.fail(msg.group, msg.step_id, msg.message))
        else:
            raise protocol.ProtocolError(f"{type(msg).__name__} is not expected on the feedback link")
        self._events.first_tokens += self.engine.take_first_tokens()
        return self._frees()

    def take_events(self) -> Events | None:
        """Text, first tokens and finished requests since the last call (None: nothing new)."""
        self._events.first_tokens += self.engine.take_first_tokens()
        self._events.text += [(int(rid), delta) for rid, delta in self.engine.take_text()]
        if not self._events:
            return None
        events, self._events = self._events, Events()
        return events

    def take_status(self) -> Status | None:
        """Queue depth, active rows and free KV blocks, when they changed since the last call."""
        st = self.engine.status()
        key = (st.waiting, st.running, st.free_blocks)
        if key == self._last_status:
            return None
        self._last_status = key
        return Status(waiting=st.waiting, running=st.running, max_num_seqs=st.max_num_seqs,
                      free_blocks=st.free_blocks, total_blocks=st.total_blocks)

    def _finished(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            self._events.done.append(Result(request_id=int(out.request_id), token_ids=out.token_ids, text=out.text,
                                            finish_reason=out.finish_reason, error=out.error))

    def _frees(self) -> list[Frame]:
        freed = self.engine.take_freed()
        return [protocol.to_frame(Free(request_ids=freed), stage_from=0, stage_to=1)] if freed else []

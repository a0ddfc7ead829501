"""A stage's serving logic without its IO, in its two roles, and what it measures of itself.

- :class:`Head` (stage 0) wraps the :class:`~stagewise.engine.engine.Engine` whose executor holds
  stage 0's layers: the driver's requests in, steps to stage 1, the tokens of the last stage
  back, events for the driver. A request's KV is freed downstream before any step that may reuse
  its blocks.
- :class:`Worker` (stages 1 .. S-1) wraps an :class:`~stagewise.engine.executor.Executor`: a
  frame from the previous stage in, the frames to send out. A step runs through the executor; the
  result goes to the next stage (hidden states) or, from the last stage, back to stage 0 (the
  sampled tokens). Frees and step failures pass along the chain. A frame that does not fit raises
  :class:`~stagewise.pipeline.protocol.ProtocolError` (the process logs it and serves on); a step
  that fails while running becomes a :class:`~stagewise.pipeline.protocol.StepFailed` for stage 0.
- :class:`StageStats`: time computing, sending and waiting, bytes moved, and a timeline of spans.

The stage process (:mod:`stagewise.pipeline.process`) feeds them what arrives and sends what they
return.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from stagewise.engine.engine import Engine
from stagewise.engine.executor import Executor, RanksOutOfStep, model_dtype
from stagewise.engine.requests import RequestOutput
from stagewise.pipeline import protocol
from stagewise.pipeline.messages import Add, Cancel, Events, NewToken, ResetPrefixCache, Result, Stats, Status
from stagewise.pipeline.protocol import Free, ProtocolError, ResetKV, StageShape, Step, StepFailed, Tokens
from stagewise.transport.frame import Frame

MAX_TRACE_EVENTS = 200_000


@dataclass(slots=True)
class StageStats:
    """What a stage measures of itself since it started or was last reset."""

    busy_s: float = 0.0
    send_s: float = 0.0
    recv_wait_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rejected_frames: int = 0
    started_s: float = field(default_factory=time.perf_counter)
    trace: list[tuple[str, float, float, int]] = field(default_factory=list)
    """(name, start, duration, microbatch): name is compute, send or recv-wait; start is
    ``time.perf_counter()`` (CLOCK_MONOTONIC: one time base for all processes of a host)."""

    def reset(self) -> None:
        """Start counting afresh (the same object: the head or worker keeps its reference)."""
        fresh = StageStats()
        for name in self.__slots__:
            setattr(self, name, getattr(fresh, name))

    def event(self, name: str, start: float, end: float, microbatch: int = -1) -> None:
        if len(self.trace) < MAX_TRACE_EVENTS:
            self.trace.append((name, start, end - start, microbatch))

    def computed(self, start: float, end: float, tokens: int, microbatch: int) -> None:
        """One step of ``tokens`` tokens computed between ``start`` and ``end``."""
        self.busy_s += end - start
        self.steps += 1
        self.tokens += tokens
        self.event("compute", start, end, microbatch)

    def report(self, stage: int, layers: tuple[int, int], *, trace: bool) -> Stats:
        return Stats(stage=stage, layers=layers, busy_s=self.busy_s, send_s=self.send_s,
                     recv_wait_s=self.recv_wait_s, steps=self.steps, tokens=self.tokens, bytes_sent=self.bytes_sent,
                     bytes_received=self.bytes_received, rejected_frames=self.rejected_frames,
                     wall_s=time.perf_counter() - self.started_s, trace=list(self.trace) if trace else None)


class Head:
    """Stage 0's serving logic over one engine. With one stage (of several ranks: a lone stage of
    one rank runs in the caller's process) the engine holds every layer and completes each step
    itself; nothing goes downstream."""

    def __init__(self, engine: Engine, *, stats: StageStats | None = None) -> None:
        self.engine = engine
        self.alone = engine.executor.is_last
        self._num_layers = len(engine.executor.model.layers)
        self.stats = stats if stats is not None else StageStats()
        self._events = Events()
        self._last_status: tuple | None = None

    @property
    def busy(self) -> bool:
        """A step is in flight or a request waits to run."""
        return bool(self.engine.inflight) or self.engine.has_unfinished()

    def on_message(self, msg: Add | Cancel | ResetPrefixCache | Result) -> None:
        """A request to add or cancel (problems become that request's error result), a reset of
        the prefix cache, or the result of a request that could not be read (it ends so)."""
        if isinstance(msg, Result):
            self._events.done.append(msg)
        elif isinstance(msg, Add):
            try:
                self.engine.add_request(msg.request_id, msg.prompt_ids, msg.params, msg.images, resumed=msg.resumed)
            except (ValueError, TypeError) as err:
                self._events.done.append(Result(request_id=msg.request_id, token_ids=[], finish_reason="error",
                                                error=str(err)))
        elif isinstance(msg, Cancel):  # the request ends at once; its KV is freed on every stage
            out = self.engine.cancel(msg.request_id)
            if out is not None:
                self._finished([out])
        elif isinstance(msg, ResetPrefixCache):
            self.engine.reset_prefix_cache()
        else:
            raise TypeError(f"Head.on_message: expected Add, Cancel, ResetPrefixCache or Result, got "
                            f"{type(msg).__name__}")

    def launch(self) -> Iterator[Frame]:
        """Every idle group with work: schedule it, run stage 0's layers. Yields the frames for
        stage 1 in order, each group's as soon as it is computed (stage 1 starts on it while the
        next group computes here): frees before the steps that may reuse the freed blocks, and a
        reset of every stage's KV pools, when one is due, before any step."""
        if self.engine.reset_kv_if_due() and not self.alone:
            yield from self._frees()
            yield protocol.to_frame(ResetKV(), stage_from=0, stage_to=1)
        for group in self.engine.idle_groups_with_work():
            start = time.perf_counter()
            launched, done = self.engine.launch(group)
            end = time.perf_counter()
            self._finished(done)
            yield from self._frees()
            if launched is not None and self.alone:
                self.stats.computed(start, end, launched.batch.num_tokens, group)
                sampled = launched.output
                self._finished(self.engine.complete(group, launched.step_id, launched.batch.sampled_ids(),
                                                    sampled.tokens.tolist(), sampled.logprobs, sampled.counts))
            elif launched is not None:
                self.stats.computed(start, end, launched.batch.num_tokens, group)
                step = Step(step_id=launched.step_id, group=group,
                            batch=launched.batch.for_next_stage(launched.output, layers=self._num_layers),
                            sampling=protocol.encode_sampling(launched.sampling))
                yield protocol.to_frame(step, stage_from=0, stage_to=1)
        yield from self._frees()

    @staticmethod
    def read(frame: Frame) -> protocol.Message:
        """The message of a frame on the feedback link (ProtocolError when it does not fit); pure,
        so also what the link runs to warm its path while the tokens are due (Channel.warm)."""
        return protocol.from_frame(frame, None)

    def on_feedback(self, msg: Tokens | StepFailed) -> list[Frame]:
        """The last stage's answer to a step; returns frames for stage 1 (frees)."""
        if isinstance(msg, Tokens):
            self._finished(self.engine.complete(msg.group, msg.step_id, msg.request_ids, msg.tokens, msg.logprobs,
                                                msg.counts))
        elif isinstance(msg, StepFailed):
            self._finished(self.engine.fail(msg.group, msg.step_id, msg.message))
        else:
            raise protocol.ProtocolError(f"{type(msg).__name__} is not expected on the feedback link")
        return self._frees()

    def take_events(self) -> Events | None:
        """New tokens and finished requests since the last call (None: nothing new)."""
        self._events.tokens += [NewToken(request_id=int(rid), token=token, logprobs=lp)
                                for rid, token, lp in self.engine.take_tokens()]
        if not self._events:
            return None
        events, self._events = self._events, Events()
        return events

    def take_status(self) -> Status | None:
        """Queue depth, active rows and free KV blocks, when they changed since the last call."""
        st = self.engine.status()
        key = (st.waiting, st.running, st.free_blocks, st.cached_blocks, st.evicted_blocks)
        if key == self._last_status:
            return None
        self._last_status = key
        return Status(waiting=st.waiting, running=st.running, max_num_seqs=st.max_num_seqs,
                      free_blocks=st.free_blocks, total_blocks=st.total_blocks, cached_blocks=st.cached_blocks,
                      evicted_blocks=st.evicted_blocks)

    def _finished(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            self._events.done.append(Result(request_id=int(out.request_id), token_ids=out.token_ids,
                                            finish_reason=out.finish_reason, error=out.error,
                                            cached_tokens=out.cached_tokens, draft_tokens=out.draft_tokens,
                                            accepted_tokens=out.accepted_tokens))

    def _frees(self) -> list[Frame]:
        freed = self.engine.take_freed()
        if not freed or self.alone:
            return []
        return [protocol.to_frame(Free(request_ids=freed), stage_from=0, stage_to=1)]


class Route(enum.Enum):
    DOWNSTREAM = "downstream"
    """To the next stage."""
    FEEDBACK = "feedback"
    """From the last stage back to stage 0."""


class Worker:
    """Stage ``index`` (>= 1) of ``num_stages``, over one executor."""

    def __init__(self, executor: Executor, *, index: int, num_stages: int, stats: StageStats | None = None) -> None:
        if executor.is_first:
            raise ValueError("Worker: stage 0 runs a Head (it owns the scheduler)")
        if not 1 <= index < num_stages:
            raise ValueError(f"Worker: index must be in [1, {num_stages}), got {index}")
        self.executor, self.index, self.num_stages = executor, index, num_stages
        self.is_last = index == num_stages - 1
        if self.is_last != executor.is_last:
            raise ValueError(f"Worker: stage {index} of {num_stages} holds layers up to "
                             f"{executor.model.end_layer} of {executor.model.config.num_layers}")
        self.stats = stats if stats is not None else StageStats()
        self.shape = StageShape(index=index, hidden_size=executor.model.config.hidden_size,
                                dtype=model_dtype(executor.model), max_model_len=executor.max_model_len,
                                device=executor.device)
        self._out = Route.FEEDBACK if self.is_last else Route.DOWNSTREAM
        self._num_layers = len(executor.model.layers)

    def read(self, frame: Frame) -> protocol.Message:
        """The message of a frame from the previous stage (ProtocolError when it does not fit); pure,
        so also what the upstream link runs to warm its path while a step is due (Channel.warm)."""
        return protocol.from_frame(frame, self.shape)

    def handle(self, frame: Frame) -> list[tuple[Route, Frame]]:
        """The frames to send for one received frame (ProtocolError when it does not fit)."""
        msg = self.read(frame)
        if isinstance(msg, Free | ResetKV):
            if isinstance(msg, Free):
                self.executor.free(msg.request_ids)
            else:
                self.executor.reset_kv()
            return [] if self.is_last else [(Route.DOWNSTREAM, self._to_next(msg))]
        if isinstance(msg, StepFailed):
            return [(self._out, self._to_next(msg))]
        if isinstance(msg, Step):
            return [(self._out, self._run(msg))]
        raise ProtocolError(f"{type(msg).__name__} is not expected from the previous stage")

    def _run(self, step: Step) -> Frame:
        batch, executor = step.batch, self.executor
        hits = batch.prefix_blocks or ()
        unknown = [r for i, r in enumerate(batch.request_ids)
                   if (i >= batch.num_prefills or batch.context_lens[i]) and not (hits and hits[i]) and r not in executor]
        if unknown:
            raise ProtocolError(f"(step {step.step_id}): unknown request ids {unknown[:4]} in rows that continue "
                                "a request (decodes, later prefill chunks)")
        sampling = protocol.decode_sampling(step.sampling) if self.is_last else None
        start = time.perf_counter()
        try:
            out = executor.run(batch, sampling)
        except RanksOutOfStep:
            raise  # the stage itself is broken: it stops, and the driver names the cause
        except Exception as err:  # noqa: BLE001 - the step's requests fail, the stage serves on
            message = f"stage {self.index} step failed: {type(err).__name__}: {err}"
            return self._to_next(StepFailed(step_id=step.step_id, group=step.group, message=message))
        self.stats.computed(start, time.perf_counter(), batch.num_tokens, step.group)
        if self.is_last:
            return self._to_next(protocol.tokens_message(step.step_id, step.group, batch.sampled_ids(), out))
        next_batch = batch.for_next_stage(out, layers=self._num_layers)
        return self._to_next(Step(step_id=step.step_id, group=step.group, batch=next_batch, sampling=step.sampling))

    def _to_next(self, msg: protocol.Message) -> Frame:
        return protocol.to_frame(msg, stage_from=self.index, stage_to=0 if self.is_last else self.index + 1)

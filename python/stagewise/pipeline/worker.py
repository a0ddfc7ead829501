"""A later stage of a pipeline (1 .. S-1) without its IO: a frame from the previous stage in,
the frames to send out.

A step runs through this stage's executor; the result goes to the next stage (hidden states) or,
from the last stage, back to stage 0 (the sampled tokens). Frees and step failures pass along the
chain; the last stage sends failures back to stage 0. A frame that does not fit raises
:class:`~stagewise.pipeline.protocol.ProtocolError` (the process logs it and serves on); a step
that fails while running becomes a :class:`~stagewise.pipeline.protocol.StepFailed` for stage 0,
and the stage serves on.
"""

from __future__ import annotations

import enum
import time

from stagewise.engine.executor import Executor, model_dtype
from stagewise.pipeline import protocol
from stagewise.pipeline.protocol import Free, ProtocolError, StageShape, Step, StepFailed
from stagewise.pipeline.stats import StageStats
from stagewise.transport.frame import Frame


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

    def handle(self, frame: Frame) -> list[tuple[Route, Frame]]:
        """The frames to send for one received frame (ProtocolError when it does not fit)."""
        msg = protocol.from_frame(frame, self.shape)
        if isinstance(msg, Free):
            self.executor.free(msg.request_ids)
            return [] if self.is_last else [(Route.DOWNSTREAM, self._to_next(msg))]
        if isinstance(msg, StepFailed):
            return [(self._out, self._to_next(msg))]
        if isinstance(msg, Step):
            return [(self._out, self._run(msg))]
        raise ProtocolError(f"{type(msg).__name__} is not expected from the previous stage")

    def _run(self, step: Step) -> Frame:
        batch, executor = step.batch, self.executor
        unknown = [r for i, r in enumerate(batch.request_ids) if i >= batch.num_prefills and r not in executor]
        if unknown:
            raise ProtocolError(f"(step {step.step_id}): unknown request ids {unknown[:4]} in decode rows")
        sampling = protocol.decode_sampling(step.sampling) if self.is_last else None
        start = time.perf_counter()
        try:
            out = executor.run(batch, sampling)
        except Exception as err:  # noqa: BLE001 - the step's requests fail, the stage serves on
            message = f"stage {self.index} step failed: {type(err).__name__}: {err}"
            return self._to_next(StepFailed(step_id=step.step_id, group=step.group, message=message))
        self.stats.computed(start, time.perf_counter(), batch.num_tokens, step.group)
        if self.is_last:
            return self._to_next(protocol.tokens_message(step.step_id, step.group, batch.request_ids, out))
        return self._to_next(Step(step_id=step.step_id, group=step.group, batch=batch.for_next_stage(out),
                                  sampling=step.sampling))

    def _to_next(self, msg: protocol.Message) -> Frame:
        return protocol.to_frame(msg, stage_from=self.index, stage_to=0 if self.is_last else self.index + 1)

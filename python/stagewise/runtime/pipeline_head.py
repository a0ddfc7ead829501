"""Stage 0 of a pipeline: the scheduler, detokenisation and stop rules of the
:class:`~stagewise.runtime.engine.Engine`, over microbatch groups whose steps overlap.

The head keeps up to ``num_groups`` steps in flight (one per group, seed 002's user rows split
into microbatches): it schedules a group, runs its own layers and hands the hidden states to
the caller, who sends them down the pipeline; when the last stage's sampled tokens for that
group come back, :meth:`PipelineHead.on_tokens` records them exactly as the single-process
engine does, and the group can run its next step. Every request that ends (stop, length,
cancel, error) is listed by :meth:`take_freed` so that the caller tells the other stages to free
its KV.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from stagewise.model.batch import KVMetadata, StepBatch
from stagewise.model.stage import StageModel
from stagewise.runtime.engine import DEFAULT_BLOCK_SIZE, Engine, RequestOutput
from stagewise.runtime.scheduler import ScheduledStep


@dataclass(kw_only=True, slots=True)
class HeadStep:
    """One group's step, after stage 0's layers."""

    group: int
    step_id: int
    batch: StepBatch
    hidden_states: torch.Tensor
    """``[T, hidden]``: stage 0's output, the next stage's input."""
    sampling: dict[Hashable, dict]
    """Sampling parameters (``SamplingParams`` fields) of the requests that start in this step;
    the last stage needs them to sample."""


class PipelineHead(Engine):
    """The engine of stage 0: requests, scheduling and token bookkeeping for the whole pipeline."""

    def __init__(self, model: StageModel, *, num_groups: int, num_blocks: int, tokenizer=None,
                 device: torch.device | str = "cpu", max_num_seqs: int = 32, max_model_len: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, max_prefill_tokens: int = 8192) -> None:
        if model.is_last:
            raise ValueError("PipelineHead: the model holds every layer; use Engine for a single stage")
        super().__init__(model, tokenizer=tokenizer, device=device, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len, max_num_tokens=num_blocks * block_size, block_size=block_size,
                         max_prefill_tokens=max_prefill_tokens, pipeline_groups=num_groups)
        self.inflight: dict[int, tuple[int, ScheduledStep]] = {}
        self._next_step_id = 0
        self._freed: list[Hashable] = []

    @property
    def num_groups(self) -> int:
        return self.scheduler.num_groups

    def step(self) -> list[RequestOutput]:  # the single-process loop does not apply
        raise TypeError("PipelineHead.step: a pipeline head runs launch_steps() / on_tokens()")

    def _finish(self, request_id: Hashable, reason: str, error: str | None = None) -> RequestOutput:
        out = super()._finish(request_id, reason, error)
        self._freed.append(request_id)
        return out

    @property
    def has_freed(self) -> bool:
        return bool(self._freed)

    def take_freed(self) -> list[Hashable]:
        """Requests that ended since the last call: every later stage must free their KV."""
        freed, self._freed = self._freed, []
        return freed

    def idle_groups_with_work(self) -> list[int]:
        return [g for g in range(self.num_groups) if g not in self.inflight and self.scheduler.has_work(g)]

    def launch(self, group: int) -> tuple[HeadStep | None, list[RequestOutput]]:
        """Schedule ``group`` and run stage 0's layers on it. Returns the step to send on (None
        when the group has nothing to run) and the requests that ended (no KV for them)."""
        if group in self.inflight:
            raise ValueError(f"PipelineHead.launch: group {group} already has step {self.inflight[group][0]} "
                             "in flight")
        plan = self.scheduler.schedule(group)
        done = [self._finish(seq.request_id, "error", message) for seq, message in plan.failed]
        if plan.empty:
            return None, done
        try:
            batch = self._batch(plan)
            hidden = self.model(batch, self.kv_cache, KVMetadata.build(batch, self.manager, self.device))
        except Exception as err:  # noqa: BLE001 - a failed step ends its requests, not the pipeline
            message = f"stage 0 step failed: {type(err).__name__}: {err}"
            return None, done + [self._finish(s.request_id, "error", message) for s in plan.prefills + plan.decodes]
        step_id, self._next_step_id = self._next_step_id, self._next_step_id + 1
        self.inflight[group] = (step_id, plan)
        sampling = {s.request_id: dataclasses.asdict(self._requests[s.request_id].params) for s in plan.prefills}
        return HeadStep(group=group, step_id=step_id, batch=batch, hidden_states=hidden, sampling=sampling), done

    def _take(self, group: int, step_id: int) -> ScheduledStep:
        entry = self.inflight.get(group)
        if entry is None or entry[0] != step_id:
            raise ValueError(f"PipelineHead: no step {step_id} in flight for group {group} "
                             f"(in flight: {None if entry is None else entry[0]})")
        del self.inflight[group]
        return entry[1]

    def on_tokens(self, group: int, step_id: int, request_ids: list[Hashable],
                  tokens: list[int]) -> list[RequestOutput]:
        """The last stage's sampled tokens of a step; returns the requests that ended."""
        plan = self._take(group, step_id)
        expected = [s.request_id for s in plan.prefills + plan.decodes]
        if list(request_ids) != expected:
            raise ValueError(f"PipelineHead.on_tokens: step {step_id} carries requests {list(request_ids)[:8]}, "
                             f"expected {expected[:8]}")
        return self._record_tokens(plan, tokens)

    def on_step_failed(self, group: int, step_id: int, message: str) -> list[RequestOutput]:
        """A later stage could not run the step: its requests end with ``message``."""
        plan = self._take(group, step_id)
        return [self._finish(s.request_id, "error", message) for s in plan.prefills + plan.decodes
                if s.request_id in self._requests]

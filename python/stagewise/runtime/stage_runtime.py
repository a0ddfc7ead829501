"""The compute side of a pipeline stage after stage 0: rows in, hidden states (or sampled
tokens on the last stage) out, against this stage's own paged KV cache.

A stage learns about a request when it first sees it (a prefill row), allocates its KV blocks
then and one slot per decode row, and frees them when stage 0 says the request ended (seed 000
§2.2; no stage asks another for KV). Every stage runs the same block size and block count as
stage 0, so allocations mirror stage 0's scheduler and cannot fail where stage 0's succeeded.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from stagewise.kv import KVCache, KVCacheManager
from stagewise.model.batch import KVMetadata, StepBatch
from stagewise.model.stage import StageModel
from stagewise.runtime.sampling import Sampler, SamplingParams, make_generator


@dataclass(frozen=True, slots=True)
class StepRow:
    """One request of a step as it crosses a stage boundary."""

    request_id: Hashable
    first_position: int
    """Position of the row's first token (tokens already cached for a decode, 0 for a prefill)."""
    num_tokens: int
    prefill: bool


def rows_of(batch: StepBatch) -> list[StepRow]:
    return [StepRow(rid, ctx, n, i < batch.num_prefills)
            for i, (rid, ctx, n) in enumerate(zip(batch.request_ids, batch.context_lens, batch.query_lens))]


def batch_from_rows(rows: Sequence[StepRow], hidden_states: torch.Tensor) -> StepBatch:
    """The :class:`StepBatch` a later stage runs: prefills first, positions from the rows."""
    seen_decode = False
    for row in rows:
        if row.prefill and seen_decode:
            raise ValueError("stage step: prefill rows must come before decode rows")
        seen_decode |= not row.prefill
    positions = [p for r in rows for p in range(r.first_position, r.first_position + r.num_tokens)]
    return StepBatch(request_ids=[r.request_id for r in rows], num_prefills=sum(r.prefill for r in rows),
                     query_lens=[r.num_tokens for r in rows],
                     context_lens=[0 if r.prefill else r.first_position for r in rows],
                     positions=torch.tensor(positions, dtype=torch.int64, device=hidden_states.device),
                     hidden_states=hidden_states)


class StageRuntime:
    """A later stage's model, KV cache and (on the last stage) sampler."""

    def __init__(self, model: StageModel, *, num_blocks: int, block_size: int, max_model_len: int,
                 device: torch.device | str = "cpu", kv_dtype: torch.dtype | None = None) -> None:
        if model.is_first:
            raise ValueError("StageRuntime: stage 0 runs a PipelineHead (it owns the scheduler)")
        self.model, self.device = model, torch.device(device)
        dtype = kv_dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        spec = model.kv_cache_spec(block_size, dtype)
        self.kv_cache = KVCache(spec, max_num_tokens=num_blocks * block_size, device=self.device)
        self.manager = KVCacheManager(block_size=block_size, num_blocks=self.kv_cache.num_blocks,
                                      max_blocks_per_seq=-(-max_model_len // block_size))
        self.sampler = Sampler()
        self._sampling: dict[Hashable, tuple[SamplingParams, torch.Generator | None]] = {}

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    def run(self, rows: Sequence[StepRow], hidden_states: torch.Tensor,
            sampling: dict[Hashable, dict] | None = None) -> torch.Tensor:
        """Hidden states for the next stage, or on the last stage the sampled token ids ``[R]``.
        KV for new requests is allocated here; on an error the step's new requests are freed."""
        batch = batch_from_rows(rows, hidden_states)
        added = []
        try:
            for row in rows:
                if row.prefill:
                    if row.request_id in self.manager:
                        raise ValueError(f"request {row.request_id!r} starts a prefill but already has KV here")
                    self.manager.add(row.request_id, row.num_tokens)
                    added.append(row.request_id)
                else:
                    have = self.manager.num_tokens(row.request_id) if row.request_id in self.manager else None
                    if have != row.first_position:
                        raise ValueError(f"request {row.request_id!r} decodes at position {row.first_position} but "
                                         f"this stage holds {have} of its tokens")
                    self.manager.append(row.request_id, 1)
            if self.is_last:
                for row in rows:
                    if row.prefill:
                        params = SamplingParams(**(sampling or {})[row.request_id])
                        self._sampling[row.request_id] = (params, make_generator(params, self.device))
                    elif row.request_id not in self._sampling:
                        raise ValueError(f"request {row.request_id!r} has no sampling parameters on the last stage")
            out = self.model(batch, self.kv_cache, KVMetadata.build(batch, self.manager, self.device))
            if not self.is_last:
                return out
            entries = [self._sampling[r.request_id] for r in rows]
            return self.sampler.sample(out, [p for p, _ in entries], [g for _, g in entries])
        except Exception:
            self.free(added)
            raise

    def free(self, request_ids: Sequence[Hashable]) -> None:
        """Forget requests that ended (unknown ids are ignored: a request may end before it
        reached this stage)."""
        for rid in request_ids:
            if rid in self.manager:
                self.manager.free(rid)
            self._sampling.pop(rid, None)

"""What one forward step of one stage reads: :class:`StepBatch` and :class:`KVMetadata`.

A step's tokens are flattened request by request into ``T`` rows: first the
``num_prefills`` prefill requests, each with its whole prompt, then the decode
requests with one token each. :class:`StepBatch` is what crosses a stage
boundary (request ids, lengths, positions and the tokens or hidden states);
:class:`KVMetadata` is stage-local, because every stage owns its own block pool
and so its own block ids, and is built by each stage from its
:class:`~stagewise.kv.KVCacheManager`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from stagewise.kv import KVCacheManager


def _fail(owner: str, name: str, value: object, expected: str) -> ValueError:
    return ValueError(f"{owner}.{name}: expected {expected}, got {value!r}")


@dataclass(kw_only=True, slots=True)
class StepBatch:
    """The requests of one step and the input of one stage (token ids or hidden states)."""

    request_ids: tuple[Hashable, ...]
    """One id per request, in row order (prefills first)."""
    num_prefills: int
    """The first ``num_prefills`` requests run their whole prompt; the rest decode one token."""
    query_lens: tuple[int, ...]
    """Tokens of each request in this step: the prompt length for a prefill, 1 for a decode."""
    context_lens: tuple[int, ...]
    """Tokens of each request already in the KV cache before this step (0 for a prefill)."""
    positions: torch.Tensor
    """``[T]`` int64 position of each token."""
    token_ids: torch.Tensor | None = None
    """``[T]`` int64: the input of stage 0."""
    hidden_states: torch.Tensor | None = None
    """``[T, hidden]``: the input of a later stage (the previous stage's output)."""
    residual: torch.Tensor | None = None
    """``[T, hidden]``: residual stream still to be added to ``hidden_states``, if the sender kept
    them apart. Stages send the sum (see :meth:`StageModel.forward`), which is bitwise the same
    for the next layer and half the bytes."""
    all_logits: bool = False
    """Last stage: logits of every token ``[T, vocab]`` instead of each request's last ``[R, vocab]``."""

    def __post_init__(self) -> None:
        self.request_ids, self.query_lens = tuple(self.request_ids), tuple(self.query_lens)
        self.context_lens = tuple(self.context_lens)
        r = len(self.request_ids)
        if len(set(self.request_ids)) != r:
            raise _fail("StepBatch", "request_ids", self.request_ids, "distinct ids")
        for name in ("query_lens", "context_lens"):
            if len(getattr(self, name)) != r:
                raise _fail("StepBatch", name, getattr(self, name), f"{r} entries (one per request)")
        if not 0 <= self.num_prefills <= r:
            raise _fail("StepBatch", "num_prefills", self.num_prefills, f"an int in [0, {r}]")
        p = self.num_prefills
        if any(n < 1 for n in self.query_lens[:p]) or any(c != 0 for c in self.context_lens[:p]):
            raise _fail("StepBatch", "query_lens/context_lens", (self.query_lens[:p], self.context_lens[:p]),
                        "prefills with >= 1 token and an empty cache (chunked prefill is not supported)")
        if any(n != 1 for n in self.query_lens[p:]) or any(c < 0 for c in self.context_lens[p:]):
            raise _fail("StepBatch", "query_lens/context_lens", (self.query_lens[p:], self.context_lens[p:]),
                        "decodes of exactly 1 token with context_lens >= 0")
        t = self.num_tokens
        if self.positions.shape != (t,):
            raise _fail("StepBatch", "positions", tuple(self.positions.shape), f"shape ({t},)")
        if (self.token_ids is None) == (self.hidden_states is None):
            raise _fail("StepBatch", "token_ids/hidden_states", "both or neither", "exactly one of them")
        if self.token_ids is not None and self.token_ids.shape != (t,):
            raise _fail("StepBatch", "token_ids", tuple(self.token_ids.shape), f"shape ({t},)")
        for name in ("hidden_states", "residual"):
            value = getattr(self, name)
            if value is not None and (value.dim() != 2 or value.size(0) != t):
                raise _fail("StepBatch", name, tuple(value.shape), f"shape ({t}, hidden)")
        residual, hidden = self.residual, self.hidden_states
        if residual is not None and (hidden is None or residual.shape != hidden.shape):
            raise _fail("StepBatch", "residual", tuple(self.residual.shape), "the shape of hidden_states")

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.query_lens[: self.num_prefills])

    def prefill_spans(self) -> list[tuple[int, int]]:
        """``(first_row, length)`` of each prefill request's tokens."""
        spans, start = [], 0
        for n in self.query_lens[: self.num_prefills]:
            spans.append((start, n))
            start += n
        return spans

    def last_token_rows(self) -> list[int]:
        """Row of each request's last token (where its next token is sampled from)."""
        rows, end = [], 0
        for n in self.query_lens:
            end += n
            rows.append(end - 1)
        return rows

    def for_next_stage(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None) -> StepBatch:
        """The same step with this stage's output as the next stage's input."""
        return dataclasses.replace(self, token_ids=None, hidden_states=hidden_states, residual=residual)


@dataclass(kw_only=True, slots=True)
class KVMetadata:
    """Where a step's K/V live in one stage's paged cache; shared by all its layers."""

    slot_mapping: torch.Tensor
    """``[T]`` int64 cache slot of each token (-1: not stored here)."""
    block_tables: torch.Tensor
    """``[R, max_blocks_per_seq]`` int32 block ids of each request."""
    seq_lens: torch.Tensor
    """``[R]`` int32 cached tokens of each request before the step (decode attends over them)."""

    def __post_init__(self) -> None:
        if self.slot_mapping.dim() != 1:
            raise _fail("KVMetadata", "slot_mapping", tuple(self.slot_mapping.shape), "shape (T,)")
        if self.block_tables.dim() != 2 or self.seq_lens.shape != (self.block_tables.size(0),):
            raise _fail("KVMetadata", "block_tables/seq_lens",
                        (tuple(self.block_tables.shape), tuple(self.seq_lens.shape)), "shapes (R, W) and (R,)")

    @classmethod
    def build(cls, batch: StepBatch, manager: KVCacheManager, device: torch.device | str) -> KVMetadata:
        """From this stage's manager, which must already hold ``context + query`` tokens of each request."""
        spans = list(zip(batch.request_ids, batch.context_lens, batch.query_lens, strict=True))
        block_tables = manager.block_tables(list(batch.request_ids), device)
        # One table per step: the slot mapping reads the same rows (a request appears once).
        shared = block_tables if len(set(batch.request_ids)) == len(spans) else None
        return cls(
            slot_mapping=manager.slot_mapping(spans, device, block_tables=shared),
            block_tables=block_tables,
            seq_lens=torch.tensor(batch.context_lens, dtype=torch.int32, device=device),
        )

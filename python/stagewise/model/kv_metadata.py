"""Where a step's K/V live on one rank: a prefill-context-parallel rank's share of a step
(:class:`PcpSplit`, :func:`split_for_pcp`) and the paged-cache metadata every layer of a stage reads
(:class:`KVMetadata`), built by each stage from its own :class:`~stagewise.kv.KVCacheManager`.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from dataclasses import dataclass

import torch

from stagewise.int_tensors import int_tensor
from stagewise.kv import KVCacheManager
from stagewise.model.batch import StepBatch, _fail

@dataclass(kw_only=True, slots=True, frozen=True)
class PcpSplit:
    """One prefill-context-parallel rank's share of a step, from :func:`split_for_pcp`.

    Each prompt is padded to ``2 * size`` equal parts and rank ``i`` takes part ``i`` and part
    ``2 * size - 1 - i`` (head-tail: every rank gets as much causal-attention work as the others);
    decode rows are run by every rank. Collectives pad each rank's rows to the same count, so
    ``restore`` indexes the all-gathered ``[size * pad_rows]`` rows (rank-major) to put them back in
    the full step's order.
    """

    size: int
    rank: int
    batch: StepBatch
    """This rank's rows: prefills with at least one token here (their tokens in position order),
    then every decode row; positions and inputs taken from the full step."""
    rows: torch.Tensor
    """``[S_rank]`` int64: row of the full step of each of this rank's rows."""
    pad_rows: int
    """The most rows any rank has: the row count of each rank's part of an all-gather."""
    restore: torch.Tensor
    """``[T]`` int64: for each row of the full step, its row in the all-gathered
    ``[size * pad_rows]`` (a decode row is read from rank 0)."""
    prefill_pad: int
    """The most prefill tokens any rank has."""
    prefill_restore: torch.Tensor
    """``[P]`` int64: for each prefill token of the full step, its row in the all-gathered
    ``[size * prefill_pad]`` prefill rows."""
    prefill_spans: tuple[tuple[int, int, int, int, int], ...]
    """Per prefill request of the full step: ``(first local row, local tokens, first full row, chunk
    length, tokens cached before the chunk)``."""
    cached_local: torch.Tensor
    """``[M]`` int64: this rank's rows that are :meth:`StepBatch.cached_rows` of the full step."""
    cached_take: torch.Tensor
    """``[M]`` int64: the index of each among the full step's cached rows."""


def head_tail_ranges(prompt_len: int, rank: int, size: int) -> tuple[range, range]:
    """Positions of a prompt that PCP rank ``rank`` of ``size`` runs: the prompt padded to
    ``2 * size`` parts of ``ceil(prompt_len / (2 * size))``, parts ``rank`` and ``2 * size - 1 - rank``
    (padding dropped, so either range may be short or empty)."""
    part = -(-prompt_len // (2 * size))
    tail = 2 * size - 1 - rank
    return (range(rank * part, min((rank + 1) * part, prompt_len)),
            range(tail * part, min((tail + 1) * part, prompt_len)))


def split_for_pcp(batch: StepBatch, rank: int, size: int) -> PcpSplit:
    """The rows of ``batch`` that PCP rank ``rank`` of ``size`` runs (see :class:`PcpSplit`)."""
    if not isinstance(size, int) or size < 1 or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"split_for_pcp: expected 0 <= rank < size, got rank={rank!r} size={size!r}")
    if batch.pixel_values is not None:
        raise ValueError("split_for_pcp: the step still holds pixel_values; stage 0 encodes its images "
                         "(StageModel.encode_images) before the step is split")
    spans = batch.prefill_spans()
    p, t = batch.num_prefill_tokens, batch.num_tokens
    per_rank: list[list[int]] = []  # rows, and tokens per prefill, of each rank
    lens: list[list[int]] = []
    for r in range(size):
        rows, counts = [], []
        for start, n in spans:
            head, tail = head_tail_ranges(n, r, size)
            rows.extend(start + i for part in (head, tail) for i in part)
            counts.append(len(head) + len(tail))
        per_rank.append(rows)
        lens.append(counts)
    prefill_pad = max(len(rows) for rows in per_rank)
    pad_rows = prefill_pad + t - p
    restore, prefill_restore = [0] * t, [0] * p
    for r, rows in enumerate(per_rank):
        for i, row in enumerate(rows):
            restore[row] = r * pad_rows + i
            prefill_restore[row] = r * prefill_pad + i
    for i in range(t - p):  # decode rows, the same on every rank: rank 0's copy
        restore[p + i] = len(per_rank[0]) + i
    mine = per_rank[rank] + list(range(p, t))
    device = batch.positions.device
    rows = torch.tensor(mine, dtype=torch.int64, device=device)
    local_spans, first = [], 0
    for (start, n), count, ctx in zip(spans, lens[rank], batch.context_lens[: batch.num_prefills], strict=True):
        local_spans.append((first, count, start, n, ctx))
        first += count
    keep = [j for j, count in enumerate(lens[rank]) if count] + list(range(batch.num_prefills, batch.num_requests))
    take = (lambda a: None if a is None else a[rows])
    sub = dataclasses.replace(
        batch,
        request_ids=tuple(batch.request_ids[j] for j in keep),
        num_prefills=sum(1 for count in lens[rank] if count),
        query_lens=tuple(lens[rank][j] if j < batch.num_prefills else 1 for j in keep),
        context_lens=tuple(batch.context_lens[j] for j in keep), last_chunk=tuple(batch.last_chunk[j] for j in keep),
        positions=batch.positions[rows], token_ids=take(batch.token_ids),
        mrope_positions=None if batch.mrope_positions is None else batch.mrope_positions[:, rows],
        hidden_states=take(batch.hidden_states), residual=take(batch.residual), prefix_blocks=None,
        draft_tokens=None)
    as_index = (lambda xs: torch.tensor(xs, dtype=torch.int64, device=device))
    if batch.visual_rows is not None:  # this rank's image tokens: their rows here, their features
        visual = {row: i for i, row in enumerate(batch.visual_rows.tolist())}
        local = [j for j, row in enumerate(mine) if row in visual]
        take = as_index([visual[mine[j]] for j in local])
        sub = dataclasses.replace(
            sub, visual_rows=as_index(local),
            image_embeds=None if batch.image_embeds is None else batch.image_embeds[take],
            deepstack=None if batch.deepstack is None else batch.deepstack[:, take])
    cached = {row: i for i, row in enumerate(batch.cached_rows())}
    local = [j for j, row in enumerate(mine) if row in cached]
    return PcpSplit(size=size, rank=rank, batch=sub, rows=rows, pad_rows=pad_rows, restore=as_index(restore),
                    prefill_pad=prefill_pad, prefill_restore=as_index(prefill_restore),
                    prefill_spans=tuple(local_spans), cached_local=as_index(local),
                    cached_take=as_index([cached[mine[j]] for j in local]))


@dataclass(kw_only=True, slots=True)
class KVMetadata:
    """Where a step's K/V live in one stage's paged cache; shared by all its layers.

    Under context parallelism (``cp_world_size > 1``) the rows are those of the full step (every
    PCP rank builds the same one from the full :class:`StepBatch`), the slot mapping stores only
    this rank's share, and ``pcp`` says which rows this rank runs.
    """

    slot_mapping: torch.Tensor
    """``[T]`` int64 cache slot of each token (-1: not stored here)."""
    block_tables: torch.Tensor
    """``[R, max_blocks_per_seq]`` int32 block ids of each request."""
    seq_lens: torch.Tensor
    """``[R]`` int32 cached tokens of each request before the step (decode attends over them)."""
    local_seq_lens: torch.Tensor | None = None
    """``[R]`` int32 tokens of each request this CP rank stores after the step's writes (the new
    token included when this rank owns it): what its decode attention reads. None: no CP."""
    cp_world_size: int = 1
    """Ranks the cached sequence is sharded over (``pcp * dcp``), as the manager was built."""
    cp_rank: int = 0
    pcp: PcpSplit | None = None
    """This PCP rank's rows of the step; None without prefill context parallelism."""
    cp_rows: torch.Tensor | None = None
    """``[N]`` int64, under context parallelism: the rows of the (full) step whose queries attend
    over the sharded cache, as decode rows do: every row of a prefill chunk after a prompt's
    first, then every decode row. None: no CP."""
    cp_block_tables: torch.Tensor | None = None
    """``[N, max_blocks_per_seq]`` int32: the block table of each ``cp_rows`` row's request."""
    cp_local_lens: torch.Tensor | None = None
    """``[N]`` int32: of each ``cp_rows`` row's request, the tokens this rank stores at positions up to
    the row's own (the step writes its tokens first): the row's causal limit on this rank's shard."""
    query_start_loc: torch.Tensor | None = None
    """``[P + 1]`` int32, when the step has P prefill rows and nothing is context parallel: where each
    prompt run's tokens start among the step's rows, then where the last ends (from 0)."""
    run_lens: torch.Tensor | None = None
    """``[P]`` int32 with ``query_start_loc``: each prompt run's request's tokens after the step (its
    cache and the run: what the run attends over)."""

    def __post_init__(self) -> None:
        if self.slot_mapping.dim() != 1:
            raise _fail("KVMetadata", "slot_mapping", tuple(self.slot_mapping.shape), "shape (T,)")
        if self.block_tables.dim() != 2 or self.seq_lens.shape != (self.block_tables.size(0),):
            raise _fail("KVMetadata", "block_tables/seq_lens",
                        (tuple(self.block_tables.shape), tuple(self.seq_lens.shape)), "shapes (R, W) and (R,)")
        if self.local_seq_lens is not None and self.local_seq_lens.shape != self.seq_lens.shape:
            raise _fail("KVMetadata", "local_seq_lens", tuple(self.local_seq_lens.shape),
                        f"shape {tuple(self.seq_lens.shape)}")
        if self.cp_world_size > 1:
            for name in ("local_seq_lens", "cp_rows", "cp_block_tables", "cp_local_lens"):
                if getattr(self, name) is None:
                    raise _fail("KVMetadata", name, None, f"a tensor when cp_world_size={self.cp_world_size}")

    @classmethod
    def build(cls, batch: StepBatch, manager: KVCacheManager, device: torch.device | str,
              pcp: PcpSplit | None = None) -> KVMetadata:
        """From this stage's manager, which must already hold ``context + query`` tokens of each request.
        ``batch`` is the full step (also on a PCP rank, which passes its ``pcp`` split of it)."""
        spans = list(zip(batch.request_ids, batch.context_lens, batch.query_lens, strict=True))
        block_tables = manager.block_tables(list(batch.request_ids), device)
        # One table per step: the slot mapping reads the same rows (a request appears once).
        shared = block_tables if len(set(batch.request_ids)) == len(spans) else None
        cp = {}
        if manager.cp_world_size > 1:
            cp["local_seq_lens"] = torch.tensor([manager.num_local_tokens(r) for r in batch.request_ids],
                                                dtype=torch.int32, device=device)
            rows = batch.cached_rows()
            first = [0, *itertools.accumulate(batch.query_lens)]
            requests = [bisect.bisect_right(first, row) - 1 for row in rows]
            cp["cp_rows"] = torch.tensor(rows, dtype=torch.int64, device=device)
            cp["cp_block_tables"] = block_tables[torch.tensor(requests, dtype=torch.int64, device=device)]
            # A row's place in its request's sequence (not ``positions``: a decode row of a request with
            # images carries its rope position there, shifted by the request's rope delta).
            seq = [batch.context_lens[j] + row - first[j] for row, j in zip(rows, requests)]
            lens = manager.num_local_positions(torch.tensor(seq, dtype=torch.int64, device=device) + 1)
            cp["cp_local_lens"] = lens.to(torch.int32)
        elif batch.num_prefills:  # the prompt runs for extend_attention
            p = batch.num_prefills
            cp["query_start_loc"] = int_tensor([0, *itertools.accumulate(batch.query_lens[:p])], torch.int32, device)
            cp["run_lens"] = int_tensor([c + n for c, n in zip(batch.context_lens[:p], batch.query_lens[:p])],
                                        torch.int32, device)
        return cls(slot_mapping=manager.slot_mapping(spans, device, block_tables=shared), block_tables=block_tables,
                   seq_lens=int_tensor(batch.context_lens, torch.int32, device),
                   cp_world_size=manager.cp_world_size, cp_rank=manager.cp_rank, pcp=pcp, **cp)

"""Runs given steps on one rank: a stage's layers, its paged KV cache and, on the last stage, the
sampler. The executor never schedules; whoever drives it (the single-process engine, a pipeline
stage) hands it a :class:`~stagewise.model.batch.StepBatch`.

KV lifecycle: the executor allocates a request's blocks when a step first brings it (the first
chunk of its prompt, or its first chunk after a cached prefix, whose blocks the step names:
``StepBatch.prefix_blocks``), slots for each later chunk and each decode row, and frees them when
told the request ended (its full blocks stay cached in the pool); no stage asks another for KV. The stage's layers with one attention window share a
pool (:mod:`stagewise.kv.window`): a sliding-window group gives back the blocks that fall out of
its window after every step. Every stage of a pipeline runs the same block size and pool sizes
(each group's derived from one count of full-attention blocks, ``num_blocks``), so allocations
that stage 0's scheduler admitted cannot fail on a later stage.

A request's KV on this rank can also leave and join as a
:class:`~stagewise.engine.handoff.KVHandoff` (its K/V in position order and, on the last stage, its
sampling state; on a stage of several ranks, the rank's share), so that another instance of the
stage continues it exactly.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol

import torch

from stagewise.engine.handoff import KVHandoff, KVShard, read_kv, split_handoff, tensor_fields, write_kv
from stagewise.engine.params import SamplingRequest
from stagewise.engine.step_meta import StepMetadata
from stagewise.engine.step_sampling import Sampled, StepSampler, checkpoint_vocabulary
from stagewise.kv import KVCache, KVCacheManager
from stagewise.kv.cache import group_blocks
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import split_for_pcp
from stagewise.model.loader.sharding import kv_heads_of_rank
from stagewise.model.stage import StageModel


class RanksOutOfStep(RuntimeError):
    """A step failed on a stage of several ranks after they all began it (a collective broke: a
    rank died or timed out). The ranks no longer run in lockstep; the stage cannot serve on."""


class Mirror(Protocol):
    """The other ranks of a stage, as its leader sees them: each step the leader runs and each
    request it frees is handed to them first, so that every rank of the stage runs the same steps
    (see :mod:`stagewise.pipeline.fanout`)."""

    def run(self, batch: StepBatch) -> None: ...

    def free(self, request_ids: Sequence[Hashable]) -> None: ...

    def reset_kv(self) -> None: ...


class Executor:
    """One rank's share of a model and of its KV cache.

    In a stage of several ranks every rank runs every step; only the leader (TP rank 0 of PCP rank
    0) is driven by the pipeline, and hands each step to the others through its :attr:`mirror`.
    On the last stage the leader alone receives the logits and samples."""

    def __init__(self, model: StageModel, *, num_blocks: int, block_size: int, max_model_len: int | None = None,
                 device: torch.device | str = "cpu", interleave_size: int = 1, max_num_seqs: int | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        """``num_blocks``: the full-attention pool's blocks; a sliding-window group's pool holds
        ``max_num_seqs`` rows' worth at most (None: as many blocks as the full pool);
        ``kv_cache_dtype``: what a K/V value is stored as (:data:`stagewise.kv.cache.KV_CACHE_DTYPES`)."""
        cfg = model.config
        max_model_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"Executor: max_model_len must be an int >= 1 or None, got {max_model_len!r}")
        if max_model_len > cfg.max_position_embeddings:
            # The rotary table has max_position_embeddings rows; later positions have no rotation.
            raise ValueError(f"Executor: max_model_len must be <= the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings}), got {max_model_len}")
        self.model, self.device = model, torch.device(device)
        self.max_model_len, self.block_size = max_model_len, block_size
        spec = model.kv_cache_spec(block_size, model_dtype(model), kv_cache_dtype)
        self.max_num_seqs, self.num_blocks = max_num_seqs, num_blocks
        sizes = group_blocks(spec, num_blocks, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        self.kv_cache = KVCache(spec, num_blocks=sizes, device=self.device)
        groups = model.groups
        # With context parallelism a block-table entry covers block_size * cp positions (a virtual
        # block), of which this rank stores its share: every rank allocates the same block ids.
        self.managers = [KVCacheManager(block_size=block_size, num_blocks=n,
                                        max_blocks_per_seq=-(-max_model_len // (block_size * groups.cp_size)),
                                        cp_world_size=groups.cp_size, cp_rank=groups.cp_rank,
                                        interleave_size=interleave_size, window=w)
                         for w, n in zip(spec.group_windows, sizes)]
        """One per layer group of the cache, in its order."""
        self._metadata = [StepMetadata(m, self.device) for m in self.managers]
        self.leads = groups.tp.rank == 0 and groups.pcp.rank == 0
        """Whether this rank drives the stage (and, on the last stage, samples)."""
        self.mirror: Mirror | None = None
        self.sampling = StepSampler(self.device, checkpoint_vocabulary(model))
        """The last stage's leader: each request's sampling state, and the sampling of its steps."""
        self._drafted: dict[Hashable, int] = {}
        """Drafts of each request's last step that verified some: the KV its next step may roll back."""
        self.threads_by_tokens: tuple[int, int] | None = None
        """(torch threads for a step of one token, for a larger step), or None: the process's."""

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    @property
    def constraint_s(self) -> float:
        """Seconds of this rank's steps on structured output: masks, applying them, advancing them."""
        return self.sampling.constraint_s

    @property
    def manager(self) -> KVCacheManager:
        """The first layer group's manager: every group holds the same requests and token counts."""
        return self.managers[0]

    def __contains__(self, request_id: Hashable) -> bool:
        """Whether this rank holds KV of ``request_id``."""
        return request_id in self.manager

    @property
    def requests(self) -> set[Hashable]:
        """Every request this rank keeps state of (KV or, on the last stage, sampling)."""
        return {*self.manager.request_ids(), *self.sampling.requests}

    def run(self, batch: StepBatch,
            sampling: Mapping[Hashable, SamplingRequest] | None = None) -> torch.Tensor | Sampled | None:
        """Hidden states ``[T, hidden]`` for the next stage or, on the last stage, the
        :class:`Sampled` tokens of ``batch.sampled_ids()`` (None on the last stage's other ranks).
        ``sampling`` describes the requests that start in this step (the last stage's leader keeps
        it until the request is freed). On an error the step's new requests are forgotten, and the
        exception propagates."""
        added, pinned, hits, ahead = [], {}, batch.prefix_blocks, None
        if self.threads_by_tokens is not None and \
                (want := self.threads_by_tokens[batch.num_tokens > 1]) != torch.get_num_threads():
            torch.set_num_threads(want)
        try:
            for rid, ctx in zip(batch.request_ids, batch.context_lens) if self._drafted else ():
                if rid in self._drafted and 0 < self.manager.num_tokens(rid) - ctx <= self._drafted[rid]:
                    self.truncate(rid, ctx)  # rejected drafts' blocks back before the step takes any
            if hits is not None:  # every shared block held before the step takes any (taking may evict)
                for i, blocks in enumerate(hits):
                    if blocks:
                        pinned[i] = self._pin(batch.request_ids[i], batch.context_lens[i], blocks)
            for i, (rid, ctx, n) in enumerate(zip(batch.request_ids, batch.context_lens, batch.query_lens)):
                if i < batch.num_prefills and (ctx == 0 or i in pinned):
                    if rid in self.manager:
                        raise ValueError(f"request {rid!r} starts a prefill but already has KV here")
                    added.append(rid)
                    shared = hits[i] if i in pinned else ()
                    for m in self.managers:
                        m.add(rid, ctx + n, prefix=shared)
                        if shared:
                            pinned[i].remove(m)  # the request holds them now
                else:
                    have = self.manager.num_tokens(rid) if rid in self.manager else None
                    if have != ctx:
                        what = "continues its prefill" if i < batch.num_prefills else "decodes"
                        raise ValueError(f"request {rid!r} {what} at position {ctx} but this stage holds "
                                         f"{have} of its tokens")
                    for m in self.managers:
                        m.append(rid, n)
                    self._drafted.pop(rid, None)
            if batch.draft_tokens is not None:
                self._drafted.update((rid, len(d)) for rid, d in zip(batch.request_ids, batch.draft_tokens) if d)
            if self.is_last and self.leads:
                for rid in added:
                    new = (sampling or {}).get(rid)
                    if new is None:
                        raise ValueError(f"request {rid!r} has no sampling parameters on the last stage")
                    self.sampling.start(rid, new.params, new.prompt_ids, new.output_ids)
            pcp = self.model.groups.pcp
            split = split_for_pcp(batch, pcp.rank, pcp.size) if pcp.size > 1 else None
            metas = [m.build(batch, split) for m in self._metadata]
            if self.mirror is not None:
                self.mirror.run(batch)
            entries, drafts = [], None
            if self.is_last and self.leads:
                entries = [self.sampling.requests[rid] for rid in batch.sampled_ids()]
                if batch.draft_tokens is not None:
                    drafts = [d for d, last in zip(batch.draft_tokens, batch.last_chunk) if last]
                ahead = self.sampling.ahead([e for i, e in enumerate(entries) if drafts is None or not drafts[i]])
            try:
                out = self.model(batch, self.kv_cache, metas)
            except Exception as err:
                if self.model.groups.size > 1:
                    raise RanksOutOfStep(f"{type(err).__name__}: {err}") from err
                raise
            for m in self.managers:
                if m.window is not None:
                    for rid in batch.request_ids:
                        m.trim(rid)
            if not self.is_last or not self.leads:
                return out
            return self.sampling.sample(out, entries, ahead, drafts)
        except Exception:
            if ahead is not None:  # its rows' constraints are not read any more once this returns
                concurrent.futures.wait([ahead])
            for i, holds in pinned.items():
                for m in holds:
                    m.unshare(hits[i])
            self.free(added)
            raise

    def _pin(self, rid: Hashable, ctx: int, blocks: tuple[int, ...]) -> list[KVCacheManager]:
        """Hold a starting request's cached prefix in every group; returns the managers holding it."""
        if ctx != len(blocks) * self.manager.tokens_per_block:
            raise ValueError(f"request {rid!r} starts after {len(blocks)} cached blocks, at position {ctx}")
        holds = []
        try:
            for m in self.managers:
                m.share(blocks)
                holds.append(m)
        except Exception:
            for m in holds:
                m.unshare(blocks)
            raise
        return holds

    def truncate(self, request_id: Hashable, n: int) -> None:
        """Keep a request's first ``n`` positions only (:meth:`KVCacheManager.truncate`): what a
        verifying step's rejected drafts leave (each rank of a stage truncates as it runs the step
        after; a draft model's executor is told). Its remembered decode metadata goes too: the
        blocks it named may be another's now."""
        for m in self.managers:
            m.truncate(request_id, n)
        for m in self._metadata:
            m.forget([request_id])

    def reset_kv(self) -> None:
        """Every block free, no cached ones, as in a new executor (no request may hold KV): what
        puts the stages' pools back in step after a step failed on some of them."""
        if self.mirror is not None:
            self.mirror.reset_kv()
        for m in self.managers:
            m.reset()

    def free(self, request_ids: Sequence[Hashable]) -> None:
        """Forget requests that ended (unknown ids are ignored: a request may end before it
        reached this stage)."""
        if self.mirror is not None and request_ids:
            self.mirror.free(request_ids)
        for rid in request_ids:
            for m in self.managers:
                if rid in m:
                    m.free(rid)
            self.sampling.forget(rid)
            self._drafted.pop(rid, None)
        for m in self._metadata:
            m.forget(request_ids)

    # ---- KV handoff -------------------------------------------------------------------

    def shard(self) -> KVShard | None:
        """The share of each request's KV this rank holds; None on a stage of one rank (all of it)."""
        groups = self.model.groups
        if groups.size == 1:
            return None
        heads = kv_heads_of_rank(self.model.config, groups.tp.rank, groups.tp.size)
        m = self.manager
        return KVShard(kv_heads=(heads.start, heads.stop), num_kv_heads=self.model.config.num_kv_heads,
                       cp_world_size=m.cp_world_size, cp_rank=m.cp_rank, interleave_size=m.interleave_size)

    def export_request(self, request_id: int) -> KVHandoff:
        """The KV (and, on the last stage's leader, the sampling state) this rank holds of a request:
        on a stage of several ranks each rank exports its share
        (:func:`~stagewise.engine.handoff.merge_handoffs` puts them together)."""
        if request_id not in self.manager:
            raise ValueError(f"export_request: this stage holds no KV for request {request_id!r}")
        spec = self.kv_cache.spec
        kv = read_kv(self.managers, self.kv_cache, request_id, self.manager.num_local_tokens(request_id))
        entry = self.sampling.requests.get(request_id)
        history = None
        if entry is not None and (entry.history is not None or entry.constraint is not None):
            prompt = sorted(entry.history.prompt) if entry.history is not None else []
            output = list(entry.constraint.tokens) if entry.constraint is not None \
                else list(entry.history.output.elements())
            history = (prompt, output)
        return KVHandoff(request_id=request_id, layers=(spec.layer_start, spec.layer_end),
                         num_tokens=self.manager.num_tokens(request_id),
                         **tensor_fields(kv), shard=self.shard(), sampling=None if entry is None else entry.params,
                         generator_state=None if entry is None or entry.generator is None
                         else entry.generator.get_state(), history=history)

    def import_request(self, handoff: KVHandoff) -> None:
        """Take over a request from another instance of this stage: allocate its blocks and copy
        its K/V in. A whole handoff goes to any layout (each rank takes its share of it); a share
        only to the rank of the same share. ValueError, with nothing changed, when the handoff does
        not fit this stage."""
        spec, rid, mine = self.kv_cache.spec, handoff.request_id, self.shard()
        if tuple(handoff.layers) != (spec.layer_start, spec.layer_end):
            raise ValueError(f"import_request: the handoff holds layers {list(handoff.layers)}, this stage "
                             f"[{spec.layer_start}, {spec.layer_end})")
        if handoff.shard != mine:
            if handoff.shard is not None:
                raise ValueError(f"import_request: request {rid}: the handoff is the share {handoff.shard}, this "
                                 f"rank holds {mine or 'the whole KV'}; merge the shares (merge_handoffs) first")
            handoff = split_handoff(handoff, mine)
        held = handoff.k.size(1)
        want = (spec.num_layers, held, spec.num_kv_heads, spec.head_dim)
        for name, t in (("k", handoff.k), ("v", handoff.v)):
            if tuple(t.shape) != want or not (t.is_floating_point() or t.dtype == torch.int8):
                raise ValueError(f"import_request: tensor {name!r} must be {want} (K/V or a compact cache's "
                                 f"codes), got {(tuple(t.shape), t.dtype)}")
        handoff = handoff.in_cache_dtype(spec)  # from a stage whose cache stores another dtype: converted
        samples = self.is_last and self.leads
        if samples and handoff.sampling is None:
            raise ValueError(f"import_request: request {rid} reaches the last stage without sampling parameters")
        if rid in self.manager:
            raise ValueError(f"import_request: request {rid} already has KV on this stage")
        try:
            for m in self.managers:
                m.add(rid, handoff.num_tokens)
            write_kv(self.managers, self.kv_cache, rid, *handoff.tensors)
            if samples:
                prompt, output = handoff.history or ([], [])
                self.sampling.start(rid, handoff.sampling, prompt, output, handoff.generator_state)
        except Exception:
            for m in self.managers:
                if rid in m:
                    m.free(rid)
            raise


def model_dtype(model: StageModel) -> torch.dtype:
    """The dtype a stage computes in (and caches K/V in): that of its floating-point parameters
    (block-quantised matrices are not parameters; the norms always are)."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())

"""Stage 0's serving logic: requests, scheduling and token bookkeeping over one
:class:`~stagewise.engine.executor.Executor`. It works in tokens: text (detokenisation, stop
strings) is the front end's (:mod:`stagewise.frontend.text`), so no stage needs the tokenizer.

In one process the executor holds every layer and :meth:`Engine.step` runs one step of every
microbatch group: schedule, run, sample, record. As stage 0 of a pipeline the executor holds the
first layers only: :meth:`Engine.launch` schedules one group and runs stage 0's layers, the
caller sends the hidden states down the pipeline, and :meth:`Engine.complete` records the tokens
the last stage sampled for that step. Up to ``num_groups`` steps are in flight, one per group.

A request's problems (a prompt the cache can never hold, running out of KV blocks, a step that
fails) end that request with finish_reason ``"error"``; the others go on. Every request that
ends is listed by :meth:`Engine.take_freed` when other stages hold its KV.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from stagewise.engine.executor import Executor, RanksOutOfStep, model_dtype
from stagewise.engine.images import ImageInputs, VisionRequest, prepare_images
from stagewise.engine.pacing import TpotPacer
from stagewise.engine.prefix_cache import PrefixCaching
from stagewise.engine.requests import RequestOutput, Requests
from stagewise.engine.params import SamplingParams, SamplingRequest, TokenLogprobs
from stagewise.engine.scheduler import GroupedScheduler, ScheduledStep, SchedulerStatus
from stagewise.engine.speculative import Speculation, SpeculativeConfig
from stagewise.engine.step_sampling import Sampled
from stagewise.int_tensors import int_tensor
from stagewise.kv.budget import GroupPool, KVBudget
from stagewise.kv.cache import num_cache_blocks
from stagewise.kv.window import pool_blocks
from stagewise.model import architectures
from stagewise.model.batch import StepBatch
from stagewise.model.stage import StageModel

DEFAULT_BLOCK_SIZE = 16


@dataclass(kw_only=True, slots=True)
class LaunchedStep:
    """One group's step after stage 0's layers."""

    group: int
    step_id: int
    batch: StepBatch
    output: torch.Tensor | Sampled
    """Hidden states ``[T, hidden]`` for the next stage, or the sampled tokens when the executor
    holds the last layer."""
    sampling: dict[Hashable, SamplingRequest]
    """What the last stage needs of the requests that start in this step."""


class Engine:
    """Generates for many requests at once; the executor holds stage 0's layers (or all)."""

    def __init__(self, executor: Executor, *, max_num_seqs: int = 32, num_groups: int = 1,
                 max_prefill_tokens: int = 8192, tpot_target_s: float | None = None, prefix_cache: bool = True,
                 speculative: SpeculativeConfig | None = None) -> None:
        """``tpot_target_s``: a time per output token the running requests keep while new prompts
        are prefilled beside them (:mod:`stagewise.engine.pacing`); None: prompts run as soon as
        rows, blocks and ``max_prefill_tokens`` allow. ``prefix_cache``: reuse the KV of prompt
        beginnings already computed (:mod:`stagewise.engine.prefix_cache`; not for a model with a
        sliding window). ``speculative``: draft tokens and verify them in one step
        (:mod:`stagewise.engine.speculative`; not for a model with a sliding window)."""
        if not executor.is_first:
            raise ValueError("Engine: the executor must hold the model's first layer (stage 0)")
        cfg = executor.model.config
        self.executor, self.config = executor, cfg
        self.max_model_len = executor.max_model_len
        # The scheduler counts the blocks of every layer group of the model (not only of stage 0's
        # layers), with the pool sizes every stage derives from the same full-attention count.
        theirs = executor.manager
        windows = sorted(set(architectures.layer_windows(cfg)), key=lambda w: (w is not None, w or 0))
        pools = [GroupPool(window=w, num_blocks=pool_blocks(w, full_blocks=executor.num_blocks,
                                                            block_size=executor.block_size,
                                                            max_num_seqs=executor.max_num_seqs,
                                                            max_model_len=self.max_model_len)) for w in windows]
        budget = KVBudget(pools, block_size=executor.block_size, max_blocks_per_seq=theirs.max_blocks_per_seq,
                          cp_world_size=theirs.cp_world_size)
        self._vision: dict[Hashable, VisionRequest] = {}
        """Requests with images: their images, 3-D rope positions and rope delta."""
        self.prefix = PrefixCaching(theirs, self._vision.get) if prefix_cache and windows == [None] else None
        """Stage 0's prefix cache; None when off."""
        if speculative is not None and windows != [None]:
            raise ValueError(f"speculative decoding: {cfg.arch} has sliding-window layers, whose dropped KV blocks "
                             "cannot be rolled back after rejected drafts; run it without --speculative")
        self.speculation = None if speculative is None else Speculation(speculative, speculative.drafter(
            device=executor.device, max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
            vocab_size=cfg.vocab_size), self.max_model_len)
        """Stage 0's drafts and their acceptance; None when off."""
        self.kv_reset_due = False
        """A step failed on some stages (or ranks) only: their pools reset when no request holds KV."""
        self.scheduler = GroupedScheduler(budget, num_groups=num_groups, max_num_seqs=max_num_seqs,
                                          max_model_len=self.max_model_len, max_prefill_tokens=max_prefill_tokens,
                                          prefix=self.prefix)
        self.requests = Requests(vocab_size=cfg.vocab_size, eos_token_ids=cfg.eos_token_ids,
                                 max_model_len=self.max_model_len)
        self.inflight: dict[int, tuple[int, ScheduledStep]] = {}
        """group -> (step_id, its scheduled step), while the step is in the pipeline."""
        self._next_step_id = 0
        self._freed: list[Hashable] = []
        self.pacer = None if tpot_target_s is None else TpotPacer(tpot_target_s)

    @classmethod
    def for_model(cls, model: StageModel, *, device: torch.device | str = "cpu",
                  max_num_seqs: int = 32, max_model_len: int | None = None, kv_cache_bytes: int | None = None,
                  max_num_tokens: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE, num_groups: int = 1,
                  max_prefill_tokens: int = 8192, tpot_target_s: float | None = None,
                  prefix_cache: bool = True, speculative: SpeculativeConfig | None = None,
                  kv_cache_dtype: str = "auto") -> Engine:
        """An engine over ``model`` with a KV cache sized by ``kv_cache_bytes`` or
        ``max_num_tokens`` (at most one; default: see :func:`stagewise.kv.cache.num_cache_blocks`),
        its values stored as ``kv_cache_dtype`` says."""
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"Engine: max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
        length = model.config.max_position_embeddings if max_model_len is None else max_model_len
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"Engine: max_model_len must be an int >= 1 or None, got {max_model_len!r}")
        spec = model.kv_cache_spec(block_size, model_dtype(model), kv_cache_dtype)
        blocks = num_cache_blocks(spec, device, max_num_seqs=max_num_seqs, max_model_len=length,
                                  kv_cache_bytes=kv_cache_bytes, max_num_tokens=max_num_tokens)
        executor = Executor(model, num_blocks=blocks, block_size=block_size, max_model_len=max_model_len,
                            device=device, max_num_seqs=max_num_seqs, kv_cache_dtype=kv_cache_dtype)
        return cls(executor, max_num_seqs=max_num_seqs, num_groups=num_groups, max_prefill_tokens=max_prefill_tokens,
                   tpot_target_s=tpot_target_s, prefix_cache=prefix_cache, speculative=speculative)

    @property
    def num_groups(self) -> int:
        return self.scheduler.num_groups

    # ---- requests ------------------------------------------------------------

    def add_request(self, request_id: Hashable, prompt_ids: list[int], params: SamplingParams,
                    images: ImageInputs | None = None, resumed: int = 0) -> None:
        """Queue a request, with the ``images`` its prompt's image placeholders stand for. ValueError,
        with nothing queued, for a known id, an empty prompt, ids outside the vocabulary, a prompt
        the cache can never hold, or images that do not fit the model or the prompt. (Stop strings
        are the front end's; the engine ignores ``params.stop``.) ``resumed``: how many of the
        prompt's last tokens the request generated before a restart (its penalties and its
        constraint count them as output)."""
        seq = self.requests.add(request_id, prompt_ids, params, resumed)
        try:
            vision = prepare_images(self.config, request_id, list(prompt_ids), images)
            self.scheduler.add(seq)
        except Exception:
            self.requests.discard(request_id)
            raise
        if vision is not None:
            self._vision[request_id] = vision

    def cancel(self, request_id: Hashable) -> RequestOutput | None:
        """End a queued or running request now ('cancelled'); its KV blocks are freed at once.
        None for a request that is not live."""
        if request_id not in self.requests:
            return None
        return self._end(request_id, "cancelled")

    def abort(self, request_id: Hashable, error: str) -> RequestOutput | None:
        """End a live request now with finish_reason 'error' and ``error`` (e.g. its consumer
        failed); None for a request that is not live."""
        if request_id not in self.requests:
            return None
        return self._end(request_id, "error", error)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def status(self) -> SchedulerStatus:
        st = self.scheduler.status()
        if self.prefix is None:
            return st
        return dataclasses.replace(st, cached_blocks=self.executor.manager.pool.num_cached,
                                   evicted_blocks=self.prefix.stats.evicted_blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (the blocks stay in the pool until taken); how many blocks
        were named. Requests running on go on."""
        return 0 if self.prefix is None else self.prefix.reset()

    def take_freed(self) -> list[Hashable]:
        """Requests that ended since the last call: every later stage must free their KV."""
        freed, self._freed = self._freed, []
        return freed

    def take_tokens(self) -> list[tuple[Hashable, int, TokenLogprobs | None]]:
        """(request_id, token, its logprobs or None) recorded since the last call, in order: what
        a front end streams."""
        return self.requests.take_tokens()

    # ---- steps ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of every group with work (prompt chunks + one decode token of each running
        request), when the executor holds every layer; returns the requests that ended."""
        if not self.executor.is_last:
            raise ValueError("Engine.step: the executor holds stage 0 only; run launch() and complete()")
        self.reset_kv_if_due()
        done: list[RequestOutput] = []
        for group in self.idle_groups_with_work():
            launched, ended = self.launch(group)
            done += ended
            if launched is not None:
                sampled = launched.output
                done += self.complete(group, launched.step_id, launched.batch.sampled_ids(),
                                      sampled.tokens.tolist(), sampled.logprobs, sampled.counts)
        return done

    def idle_groups_with_work(self) -> list[int]:
        return [g for g in range(self.num_groups) if g not in self.inflight and self.scheduler.has_work(g)]

    def launch(self, group: int) -> tuple[LaunchedStep | None, list[RequestOutput]]:
        """Schedule ``group`` and run the executor on it. Returns the step (None when the group
        had nothing to run or its step failed here) and the requests that ended."""
        if group in self.inflight:
            raise ValueError(f"Engine.launch: group {group} already has step {self.inflight[group][0]} in flight")
        if self.speculation is not None:
            self.speculation.draft(self.scheduler.groups[group].running.values(), self.requests.params)
        now = time.perf_counter()
        scheduled = self.scheduler.schedule(group, *self._budget(group, now))
        done = [self._end(seq.request_id, "error", message) for seq, message in scheduled.failed]
        if scheduled.empty:
            return None, done
        sampling = {c.seq.request_id: SamplingRequest.of(self.requests.params(c.seq.request_id), c.seq.prompt_ids,
                                                         self.requests.resumed(c.seq.request_id))
                    for c in scheduled.prefills if c.first}
        try:
            batch = self._batch(scheduled)
            output = self.executor.run(batch, sampling)
            if self.speculation is not None and not scheduled.prefills:  # a decode step: what a token costs
                self.speculation.timed(batch.num_tokens, time.perf_counter() - now)
        except RanksOutOfStep:
            raise  # the stage itself is broken: not one step's failure
        except Exception as err:  # noqa: BLE001 - a failed step ends its requests, not the engine
            message = f"stage 0 step failed: {type(err).__name__}: {err}"
            self._out_of_step()
            return None, done + [self._end(s.request_id, "error", message) for s in scheduled.seqs]
        step_id, self._next_step_id = self._next_step_id, self._next_step_id + 1
        self.inflight[group] = (step_id, scheduled)
        if self.pacer is not None:
            self.pacer.started(group, len(scheduled.seqs) + sum(len(s.drafts) for s in scheduled.decodes),
                               sum(c.length for c in scheduled.prefills), now, decoding=bool(scheduled.decodes))
        return LaunchedStep(group=group, step_id=step_id, batch=batch, output=output, sampling=sampling), done

    def complete(self, group: int, step_id: int, request_ids, tokens: list[int],
                 logprobs: list[TokenLogprobs | None] | None = None,
                 counts: list[int] | None = None) -> list[RequestOutput]:
        """The sampled tokens of a launched step (``counts[i]`` of them for each request that samples,
        in row order, request after request; None: one each; with their logprobs where asked);
        returns the requests that ended with them. A request that verified drafts keeps the KV of
        the accepted ones: every stage drops the rest before its next step."""
        scheduled = self._take(group, step_id)
        seqs = scheduled.sampled
        expected = [s.request_id for s in seqs]
        if list(request_ids) != expected:
            raise ValueError(f"Engine.complete: step {step_id} carries requests {list(request_ids)[:8]}, "
                             f"expected {expected[:8]}")
        if self.prefix is not None:  # the step's KV is written on every stage: its full blocks can be found
            for chunk in scheduled.prefills:
                if chunk.seq.request_id in self.requests:
                    self.prefix.written(chunk.seq, chunk.start + chunk.length)
        ended = self.requests.record(seqs, tokens, logprobs, counts)
        first_decode = len(seqs) - len(scheduled.decodes)
        for i, seq in enumerate(seqs):
            if seq.request_id not in self.requests:
                continue
            if seq.drafts:  # (the rejected drafts' slots go back when its next step is scheduled)
                self.speculation.verified(seq, 1 if counts is None else counts[i])
            if self.prefix is not None and i >= first_decode:
                self.prefix.written(seq, seq.num_cached)
        if self.pacer is not None:
            self.pacer.ended(group, time.perf_counter())
        return [self._end(rid, reason) for rid, reason in ended]

    def fail(self, group: int, step_id: int, message: str) -> list[RequestOutput]:
        """A later stage could not run a launched step: its requests end with ``message``."""
        scheduled = self._take(group, step_id)
        if self.pacer is not None:
            self.pacer.ended(group, None)
        self._out_of_step()
        return [self._end(s.request_id, "error", message) for s in scheduled.seqs if s.request_id in self.requests]

    def _out_of_step(self) -> None:
        self.kv_reset_due = True
        if self.prefix is not None:
            self.prefix.out_of_step()

    def reset_kv_if_due(self) -> bool:
        """After a step failed on some stages only, once no request holds KV and no step is in
        flight: every pool of this stage (and its other ranks) as new. True when it reset, and the
        later stages must too (``ResetKV``, after the frees of :meth:`take_freed`)."""
        if not self.kv_reset_due or self.inflight or any(g.running for g in self.scheduler.groups):
            return False
        self.executor.reset_kv()
        self.kv_reset_due = False
        if self.prefix is not None:
            self.prefix.resumed()
        return True

    def _budget(self, group: int, now: float) -> tuple[int | None, int | None]:
        """The prompt tokens and new requests the pacer allows the next step (None: no limit)."""
        if self.pacer is None:
            return None, None
        clocks = [(self.requests.first_token_s(s.request_id), len(s.output_ids))
                  for sched in self.scheduler.groups for s in sched.running.values() if s.output_ids]
        own = self.scheduler.groups[group]  # a step's rows are its group's: the decode line's basis, a draft a row
        rows = len(own.running) + sum(len(s.drafts) for s in own.running.values())
        budget = self.pacer.budget(group, clocks, rows, len(own.waiting), now)
        return (None, None) if budget is None else (budget.tokens, budget.rows)

    def _take(self, group: int, step_id: int) -> ScheduledStep:
        entry = self.inflight.get(group)
        if entry is None or entry[0] != step_id:
            raise ValueError(f"Engine: no step {step_id} in flight for group {group} "
                             f"(in flight: {None if entry is None else entry[0]})")
        del self.inflight[group]
        return entry[1]

    def _batch(self, scheduled: ScheduledStep) -> StepBatch:
        ids, lens, ctx, tokens, positions, last = [], [], [], [], [], []
        for chunk in scheduled.prefills:
            start, n = chunk.start, chunk.length
            ids.append(chunk.seq.request_id), lens.append(n), ctx.append(start), last.append(chunk.last)
            tokens += chunk.seq.prompt_ids[start : start + n]
            positions += range(start, start + n)
        for seq in scheduled.decodes:  # those with drafts first: they run as chunks
            pos, n = seq.num_cached, 1 + len(seq.drafts)  # tokens cached before this step; its slots follow
            ids.append(seq.request_id), lens.append(n), ctx.append(pos), last.append(True)
            vision = self._vision.get(seq.request_id)
            tokens.append(seq.output_ids[-1]), tokens.extend(seq.drafts)
            positions += range(pos, pos + n) if vision is None else range(pos + vision.delta, pos + vision.delta + n)
        verifying = sum(1 for seq in scheduled.decodes if seq.drafts)
        drafts = None
        if verifying:
            drafts = ((),) * len(scheduled.prefills) + tuple(seq.drafts for seq in scheduled.decodes)
        device = self.executor.device
        positions = int_tensor(positions, device=device)
        hits = None
        if any(c.first and c.seq.prefix_blocks for c in scheduled.prefills):
            hits = tuple(c.seq.prefix_blocks if c.first else () for c in scheduled.prefills)
            hits += ((),) * len(scheduled.decodes)
        return StepBatch(request_ids=ids, num_prefills=len(scheduled.prefills) + verifying, query_lens=lens,
                         context_lens=ctx, positions=positions, token_ids=int_tensor(tokens, device=device),
                         last_chunk=last, prefix_blocks=hits, draft_tokens=drafts,
                         **self._image_fields(scheduled, positions))

    def _image_fields(self, scheduled: ScheduledStep, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """When a prefill chunk of the step belongs to a prompt with images: every row's 3-D
        positions, and the embeddings and DeepStack features of the chunks' image tokens at their
        rows. The vision tower runs with a prompt's first chunk; its output is dropped after the last."""
        if not any(c.seq.request_id in self._vision for c in scheduled.prefills):
            return {}
        device = self.executor.device
        mrope = positions.expand(3, -1).clone()
        rows, embeds, deepstack = [], [], []
        offset = 0
        for chunk in scheduled.prefills:
            vision = self._vision.get(chunk.seq.request_id)
            if vision is not None:
                start, n = chunk.start, chunk.length
                mrope[:, offset:offset + n] = vision.positions[:, start:start + n].to(device)
                if vision.features is None and bool((vision.token_index >= start).any()):  # (not all cached)
                    vision.features = self.executor.model.image_features(vision.images.pixel_values.to(device),
                                                                         vision.images.image_grid_thw.to(device))
                if vision.features is not None:
                    at, e, d = vision.chunk_features(start, n)
                    rows.append(at.to(device) + offset)
                    embeds.append(e)
                    deepstack.append(d)
                if chunk.last:
                    vision.features = None
            offset += chunk.length
        fields = dict(mrope_positions=mrope)
        if sum(r.numel() for r in rows):
            fields.update(visual_rows=torch.cat(rows), image_embeds=torch.cat(embeds))
            if deepstack[0].size(0):
                fields["deepstack"] = torch.cat(deepstack, 1)
        return fields

    def _end(self, request_id: Hashable, reason: str, error: str | None = None) -> RequestOutput:
        """Every way a request ends: its result, its row and blocks back, its KV freed here and,
        through :meth:`take_freed`, on the other stages."""
        out = self.requests.finish(request_id, reason, error)
        self._vision.pop(request_id, None)
        if self.prefix is not None:
            self.prefix.forget(request_id)
        if self.speculation is not None:
            self.speculation.forget(request_id)
        self.scheduler.finish(request_id)
        self.executor.free([request_id])
        if not self.executor.is_last:
            self._freed.append(request_id)
        return out

"""The single-process engine: one :class:`StageModel` over all layers, its paged KV
cache, the scheduler, the sampler and per-request detokenisation and stop rules.

Drive it with :meth:`Engine.add_request` and :meth:`Engine.step` until
:meth:`Engine.has_unfinished` is false; every step returns the requests that ended
in it. A request's problems (a prompt the cache can never hold, running out of KV
blocks) end that request with finish_reason ``"error"``; the others go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from stagewise.kv import KVCache, KVCacheManager
from stagewise.model.batch import KVMetadata, StepBatch
from stagewise.model.stage import StageModel
from stagewise.runtime.detokenize import IncrementalDetokenizer, StopChecker
from stagewise.runtime.sampling import Sampler, SamplingParams, make_generator
from stagewise.runtime.scheduler import GroupedScheduler, ScheduledStep, Scheduler, SchedulerStatus, SeqState

TextCallback = Callable[[Hashable, str], None]
"""Called with (request_id, text delta) whenever a request's visible text grows."""

DEFAULT_BLOCK_SIZE = 16
# Default KV size when none is given: every row at full length, but at most this share of the
# memory left after the weights, and on CPU at most DEFAULT_CPU_KV_BYTES (the cache is zeroed
# up front, and a CPU run rarely fills more).
DEFAULT_KV_FRACTION = {"cpu": 0.25, "cuda": 0.5}
DEFAULT_CPU_KV_BYTES = 1 << 30


def default_num_tokens(spec, device: torch.device, max_num_seqs: int, max_model_len: int) -> int:
    """KV tokens when no size is given: every row at full length, capped (see
    DEFAULT_KV_FRACTION), but room for one full row."""
    want = max_num_seqs * max_model_len
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cap_bytes = int(free * DEFAULT_KV_FRACTION["cuda"])
    else:
        import os

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        cap_bytes = min(int(free * DEFAULT_KV_FRACTION["cpu"]), DEFAULT_CPU_KV_BYTES)
    per_token = spec.bytes_per_block() // spec.block_size
    cap = cap_bytes // per_token
    return max(min(want, cap), min(want, max_model_len), spec.block_size)


@dataclass(kw_only=True, slots=True)
class RequestOutput:
    """A request that ended: its generated ids (the stop token included), text and why it ended."""

    request_id: Hashable
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    """'stop', 'length', 'cancelled' or 'error'."""
    error: str | None = None
    arrival_s: float = 0.0
    """time.perf_counter() when it was added."""
    first_token_s: float | None = None
    """time.perf_counter() when its first token was sampled."""
    finish_s: float = 0.0


@dataclass(kw_only=True, slots=True)
class _Request:
    seq: SeqState
    params: SamplingParams
    generator: torch.Generator | None
    detok: IncrementalDetokenizer | None
    stop: StopChecker
    on_text: TextCallback | None
    text: list[str] = field(default_factory=list)
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None


class Engine:
    """Generates for many requests at once on one device."""

    def __init__(self, model: StageModel, *, tokenizer=None, device: torch.device | str = "cpu",
                 max_num_seqs: int = 32, max_model_len: int | None = None, kv_cache_bytes: int | None = None,
                 max_num_tokens: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 max_prefill_tokens: int = 8192, pipeline_groups: int | None = None) -> None:
        """``pipeline_groups``: this engine is stage 0 of a pipeline (see
        :class:`~stagewise.runtime.pipeline_head.PipelineHead`): its model may end before the last
        layer and its requests are dealt to that many microbatch groups."""
        if not model.is_first or (pipeline_groups is None and not model.is_last):
            raise ValueError(f"Engine: the model must hold every layer [0, {model.config.num_layers}), "
                             f"got [{model.start_layer}, {model.end_layer})")
        if kv_cache_bytes is not None and max_num_tokens is not None:
            raise ValueError("Engine: give at most one of kv_cache_bytes and max_num_tokens, got both")
        cfg = model.config
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"Engine: max_model_len must be an int >= 1 or None, got {max_model_len!r}")
        if max_model_len > cfg.max_position_embeddings:
            # The rotary table has max_position_embeddings rows; later positions have no rotation.
            raise ValueError(f"Engine: max_model_len must be <= the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings}), got {max_model_len}")
        self.model, self.config, self.tokenizer = model, cfg, tokenizer
        self.device = torch.device(device)
        dtype = model.embedding.dtype
        spec = model.kv_cache_spec(block_size, dtype)
        if kv_cache_bytes is None and max_num_tokens is None:
            max_num_tokens = default_num_tokens(spec, self.device, max_num_seqs, max_model_len)
        self.kv_cache = KVCache(spec, kv_cache_bytes=kv_cache_bytes, max_num_tokens=max_num_tokens,
                                device=self.device)
        self.manager = KVCacheManager(block_size=block_size, num_blocks=self.kv_cache.num_blocks,
                                      max_blocks_per_seq=-(-max_model_len // block_size))
        if pipeline_groups is None:
            self.scheduler = Scheduler(self.manager, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                       max_prefill_tokens=max_prefill_tokens)
        else:
            self.scheduler = GroupedScheduler(self.manager, num_groups=pipeline_groups, max_num_seqs=max_num_seqs,
                                              max_model_len=max_model_len, max_prefill_tokens=max_prefill_tokens)
        self.sampler = Sampler()
        self.max_model_len = max_model_len
        self._requests: dict[Hashable, _Request] = {}
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    # ---- requests ------------------------------------------------------------

    def add_request(self, request_id: Hashable, prompt_ids: list[int], params: SamplingParams,
                    on_text: TextCallback | None = None) -> None:
        """Queue a request. ValueError, with nothing queued, for an empty prompt, ids outside
        the vocabulary, a prompt longer than max_model_len, or stop strings without a tokenizer."""
        if request_id in self._requests:
            raise ValueError(f"Engine.add_request: request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"Engine.add_request: params must be SamplingParams, got {type(params).__name__}")
        ids = list(prompt_ids)
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty (it needs at least one token)")
        vocab = self.config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: prompt token ids must be ints in [0, vocab_size={vocab}), "
                             f"got {bad[:8]}{' ...' if len(bad) > 8 else ''}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer; this model has none")
        seq = SeqState(request_id=request_id, prompt_ids=ids)
        self.scheduler.add(seq)  # raises for a prompt that can never run
        detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, ids)
        eos = () if params.ignore_eos else self.config.eos_token_ids
        self._requests[request_id] = _Request(
            seq=seq, params=params, generator=make_generator(params, self.device), detok=detok,
            stop=StopChecker(params.stop, params.stop_token_ids, eos), on_text=on_text)

    def cancel(self, request_id: Hashable) -> RequestOutput | None:
        """End a queued or running request now ('cancelled'); its KV blocks are freed at once."""
        if request_id not in self._requests:
            return None
        return self._finish(request_id, "cancelled")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def status(self) -> SchedulerStatus:
        return self.scheduler.status()

    # ---- one step ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch (new prefills + one decode token of each running request) and
        return the requests that ended in it."""
        plan = self.scheduler.schedule()
        done = [self._finish(seq.request_id, "error", message) for seq, message in plan.failed]
        if plan.empty:
            return done
        seqs = plan.prefills + plan.decodes
        try:
            batch = self._batch(plan)
            logits = self.model(batch, self.kv_cache, KVMetadata.build(batch, self.manager, self.device))
            reqs = [self._requests[s.request_id] for s in seqs]
            tokens = self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs]).tolist()
        except Exception as err:  # noqa: BLE001 - a failed step ends its requests, not the engine
            message = f"step failed: {type(err).__name__}: {err}"
            return done + [self._finish(s.request_id, "error", message) for s in seqs]
        return done + self._record_tokens(plan, tokens)

    def _record_tokens(self, plan: ScheduledStep, tokens: list[int]) -> list[RequestOutput]:
        """Append each request's sampled token (one per request of ``plan``, in row order) and
        return the requests that ended with it. Requests that ended meanwhile are skipped."""
        seqs, done = plan.prefills + plan.decodes, []
        self.num_prefill_tokens += sum(len(s.prompt_ids) for s in plan.prefills)
        self.num_decode_tokens += len(plan.decodes)
        now = time.perf_counter()
        for seq, token in zip(seqs, tokens, strict=True):
            req = self._requests.get(seq.request_id)
            if req is None:
                continue  # ended during this loop (a streaming callback cancelled it)
            try:
                reason = self._append_token(req, token, now)
            except Exception as err:  # noqa: BLE001 - e.g. a streaming callback that raised
                done.append(self._finish(seq.request_id, "error", f"{type(err).__name__}: {err}"))
                continue
            if reason is not None:
                done.append(self._finish(seq.request_id, reason))
        return done

    def _batch(self, plan: ScheduledStep) -> StepBatch:
        ids, lens, ctx, tokens, positions = [], [], [], [], []
        for seq in plan.prefills:
            n = len(seq.prompt_ids)
            ids.append(seq.request_id), lens.append(n), ctx.append(0)
            tokens += seq.prompt_ids
            positions += range(n)
        for seq in plan.decodes:
            pos = seq.num_cached  # tokens cached before this step; the new slot is the next one
            ids.append(seq.request_id), lens.append(1), ctx.append(pos)
            tokens.append(seq.output_ids[-1]), positions.append(pos)
        return StepBatch(request_ids=ids, num_prefills=len(plan.prefills), query_lens=lens, context_lens=ctx,
                         positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
                         token_ids=torch.tensor(tokens, dtype=torch.int64, device=self.device))

    def _append_token(self, req: _Request, token: int, now: float) -> str | None:
        """Record one sampled token; returns the finish reason if the request ends with it."""
        seq, params = req.seq, req.params
        seq.output_ids.append(token)
        if req.first_token_s is None:
            req.first_token_s = now
        if req.stop.is_stop_token(token):  # EOS / stop ids: their own text is not shown
            self._emit(req, self._finish_text(req)[0])
            return "stop"
        piece = req.detok.push(token) if req.detok is not None else ""
        text, reason = req.stop.feed(piece)
        # max_model_len bounds prompt + generated tokens.
        out_of_room = (len(seq.output_ids) >= params.max_new_tokens
                       or len(seq.prompt_ids) + len(seq.output_ids) >= self.max_model_len)
        if reason is None and out_of_room:
            tail, reason = self._finish_text(req)
            text, reason = text + tail, reason or "length"
        self._emit(req, text)
        return reason

    def _finish_text(self, req: _Request) -> tuple[str, str | None]:
        """The text held back (detokenizer tail, possible stop-string prefix), and 'stop'
        if a stop string completes in it."""
        return req.stop.finish(req.detok.flush() if req.detok is not None else "")

    def _emit(self, req: _Request, text: str) -> None:
        if text:
            req.text.append(text)
            if req.on_text is not None:
                req.on_text(req.seq.request_id, text)

    def _finish(self, request_id: Hashable, reason: str, error: str | None = None) -> RequestOutput:
        req = self._requests.pop(request_id)
        self.scheduler.finish(request_id)
        if reason in ("cancelled", "error"):
            try:
                self._emit(req, self._finish_text(req)[0])  # text held back for a possible stop string
            except Exception:  # noqa: BLE001 - the request ends either way; its KV is already free
                pass
        seq = req.seq
        return RequestOutput(request_id=request_id, prompt_ids=seq.prompt_ids, token_ids=list(seq.output_ids),
                             text="".join(req.text), finish_reason=reason, error=error, arrival_s=req.arrival_s,
                             first_token_s=req.first_token_s, finish_s=time.perf_counter())

"""The last stage's sampling: each request's sampling state (its parameters, its seeded generator,
the tokens its penalties count, its structured-output constraint) from its first step until it
is freed, and the tokens of a step's logits: one per sampled request, or for a row that verifies
speculative drafts, the accepted ones (:func:`~stagewise.engine.verify.verify`).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from stagewise.engine.constraints import Constraint, MaskBuffer, Vocabulary, compute_masks, masks_ahead, vocabulary
from stagewise.engine.params import SamplingParams, TokenLogprobs
from stagewise.engine.sampling import History, Sampler, make_generator, token_logprobs
from stagewise.engine.verify import verify
from stagewise.model.loader import open_checkpoint


@dataclass(kw_only=True, slots=True)
class Sampled:
    """What the last stage returns for a step: the tokens of each sampled request (one, or with
    drafts verified 1 to ``k + 1``), and the log-probabilities of the requests that asked."""

    tokens: torch.Tensor
    """``int64 [N]``: every request's tokens, request after request."""
    logprobs: list[TokenLogprobs | None] | None = None
    """One entry per token (None where not asked); None when no request asked."""
    counts: list[int] | None = None
    """Tokens of each request, in order; None: one each."""


@dataclass(kw_only=True, slots=True)
class RequestSampling:
    params: SamplingParams
    generator: torch.Generator | None
    history: History | None
    """The tokens it has seen, when a penalty needs them."""
    constraint: Constraint | None = None
    """Its structured-output constraint's state, when it has one."""


class StepSampler:
    """Every request's sampling state on the last stage's leader, and the sampling of its steps."""

    def __init__(self, device: torch.device, tokenizer: Callable[[], Vocabulary]) -> None:
        """``tokenizer``: the model's vocabulary as the constraints see it, read when first needed."""
        self.device, self._tokenizer = device, tokenizer
        self.sampler = Sampler()
        self.requests: dict[Hashable, RequestSampling] = {}
        self._vocab, self._mask_buffer = None, None
        self.constraint_s = 0.0
        """Seconds of this rank's steps on structured output: masks, applying them, advancing them."""

    def start(self, rid: Hashable, params: SamplingParams, prompt_ids: Sequence[int] = (),
              output_ids: Sequence[int] = (), generator_state: torch.Tensor | None = None) -> None:
        """A request's sampling from its first step (or from a handoff: its generator's state)."""
        generator = make_generator(params, self.device)
        if generator is not None and generator_state is not None:
            generator.set_state(generator_state)
        self.requests[rid] = RequestSampling(
            params=params, generator=generator,
            history=History(prompt_ids, output_ids) if params.penalised else None,
            constraint=Constraint(self._vocabulary(), params, rid, output_ids) if params.constrained else None)

    def forget(self, rid: Hashable) -> None:
        self.requests.pop(rid, None)

    def ahead(self, rows: list[RequestSampling]) -> concurrent.futures.Future | None:
        """The constrained rows' masks computed while the forward runs, where a core is spare."""
        if any(e.constraint is not None for e in rows) and self._spare_core():
            return masks_ahead([e.constraint for e in rows], self._vocabulary(), self._masks())
        return None

    def sample(self, logits: torch.Tensor, rows: list[RequestSampling], ahead: concurrent.futures.Future | None,
               drafts: Sequence[Sequence[int]] | None = None) -> Sampled:
        """The tokens of a step: ``logits`` at ``batch.logit_rows()``; ``rows`` and ``drafts`` per
        sampled request (``ahead``: the masks of :meth:`ahead`, for the requests without drafts)."""
        if drafts is None or not any(drafts):
            return self._sample(logits, rows, ahead)
        starts = [0, *itertools.accumulate(len(d) + 1 for d in drafts)]  # each request's first logits row
        plain = [i for i, d in enumerate(drafts) if not d]
        spec = [i for i, d in enumerate(drafts) if d]
        tokens: list[list[int]] = [[] for _ in drafts]
        logprobs: list[list[TokenLogprobs | None]] = [[] for _ in drafts]
        if plain:
            one = self._sample(logits[[starts[i] for i in plain]], [rows[i] for i in plain], ahead)
            for j, (i, token) in enumerate(zip(plain, one.tokens.tolist())):
                tokens[i], logprobs[i] = [token], [None if one.logprobs is None else one.logprobs[j]]
        entries, spec_drafts = [rows[i] for i in spec], [drafts[i] for i in spec]
        raw = logits[[row for i in spec for row in range(starts[i], starts[i + 1])]]
        scores, consumed = self._mask_drafts(raw, entries, spec_drafts)
        got = verify(scores, spec_drafts, [e.params for e in entries], [e.generator for e in entries],
                     [e.history for e in entries], raw=raw)
        start = time.perf_counter()
        for j, (i, e) in enumerate(zip(spec, entries)):
            tokens[i], logprobs[i] = got.tokens[j], got.logprobs[j] or [None] * len(got.tokens[j])
            if e.history is not None:
                for t in tokens[i]:
                    e.history.append(t)
            if e.constraint is not None:  # back to the accepted drafts, then the last token
                e.constraint.rollback(consumed[j] - (len(tokens[i]) - 1))
                e.constraint.consume(tokens[i][-1:])
        if any(e.constraint is not None for e in entries):
            self.constraint_s += time.perf_counter() - start
        flat_lp = [lp for each in logprobs for lp in each]
        return Sampled(tokens=torch.tensor([t for each in tokens for t in each], dtype=torch.int64),
                       logprobs=flat_lp if any(lp is not None for lp in flat_lp) else None,
                       counts=[len(each) for each in tokens])

    def _mask_drafts(self, logits: torch.Tensor, entries: list[RequestSampling],
                     drafts: list[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
        """The verified rows' logits with each constrained position's mask applied (as given when no
        row has a constraint): the constraint advanced through the drafts before it, up to the first
        draft it refuses (rejected for sure: the positions after it are never read). Returns them and
        the drafts each constraint took."""
        if all(e.constraint is None for e in entries):
            return logits, [0] * len(entries)
        start, out, consumed, at = time.perf_counter(), logits.clone(), [], 0
        for e, d in zip(entries, drafts):
            took = 0
            if e.constraint is not None:
                for j in range(len(d) + 1):
                    masks = compute_masks([e.constraint], self._vocabulary(), self._masks())
                    if masks is not None:
                        masks.apply(out[at + j:at + j + 1], in_place=True)
                    if j == len(d) or not bool(torch.isfinite(out[at + j, d[j]])):
                        break
                    e.constraint.consume([d[j]])
                    took += 1
            consumed.append(took)
            at += len(d) + 1
        self.constraint_s += time.perf_counter() - start
        return out, consumed

    def _sample(self, logits: torch.Tensor, entries: list[RequestSampling],
                ahead: concurrent.futures.Future | None) -> Sampled:
        if not entries:  # only chunks that more of their prompts follow
            return Sampled(tokens=torch.zeros(0, dtype=torch.int64, device=logits.device))
        params = [e.params for e in entries]
        held = any(e.constraint is not None for e in entries)
        start = time.perf_counter() if held else 0.0
        if ahead is not None:
            masks = ahead.result()
        else:
            masks = compute_masks([e.constraint for e in entries], self._vocabulary(), self._masks()) if held else None
        wants_logprobs = any(p.logprobs is not None for p in params)  # they are read from the unmasked logits
        allowed = logits if masks is None else masks.apply(logits, in_place=not wants_logprobs)
        if held:
            self.constraint_s += time.perf_counter() - start
        tokens = self.sampler.sample(allowed, params, [e.generator for e in entries], [e.history for e in entries])
        logprobs = None
        if wants_logprobs:
            logprobs = token_logprobs(logits, tokens, [p.logprobs for p in params])
        if held or any(e.history is not None for e in entries):
            start = time.perf_counter()
            for e, token in zip(entries, tokens.tolist()):
                if e.history is not None:
                    e.history.append(token)
                if e.constraint is not None:
                    e.constraint.consume([token])
            if held:
                self.constraint_s += time.perf_counter() - start
        return Sampled(tokens=tokens, logprobs=logprobs)

    def _spare_core(self) -> bool:
        """Whether the masks can be computed while the forward runs: on a GPU, or when torch leaves
        a core of this process free. Else a thread beside torch's would preempt one of them, and
        every kernel waits for it (measured on 2 cores: +0.5 ms a batch-1 step, more than the
        60-220 us of mask it hides)."""
        from stagewise.launch.local import usable_cores

        return self.device.type != "cpu" or torch.get_num_threads() < usable_cores()

    def _vocabulary(self) -> Vocabulary:
        if self._vocab is None:
            self._vocab = self._tokenizer()
        return self._vocab

    def _masks(self) -> MaskBuffer:
        if self._mask_buffer is None:
            self._mask_buffer = MaskBuffer(self._vocabulary().mask_words)
        return self._mask_buffer


def checkpoint_vocabulary(model) -> Callable[[], Vocabulary]:
    """The vocabulary of ``model``'s checkpoint, as :class:`StepSampler` asks for it."""
    def read() -> Vocabulary:
        source, cfg = model.tokenizer_source, model.config
        if source is None:
            raise ValueError("structured output needs the model's tokenizer; this stage was built without its "
                             "checkpoint")
        return vocabulary(("checkpoint", str(source)), lambda: open_checkpoint(source).tokenizer(),
                          cfg.vocab_size, cfg.eos_token_ids)
    return read

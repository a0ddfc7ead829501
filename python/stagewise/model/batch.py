"""What one forward step of one stage reads: :class:`StepBatch`.

A step's tokens are flattened request by request into ``T`` rows: first the
``num_prefills`` prefill requests, each with its prompt or a chunk of it (chunked
prefill: a chunk after the first attends over the tokens already cached; a row that verifies
speculative drafts is such a chunk too), then the decode requests with one token each.
:class:`StepBatch` is what crosses a stage boundary (request ids, lengths, positions, the tokens
or hidden states, the cached blocks a request starts with, the drafts a row verifies); where its
K/V live on a rank, :class:`~stagewise.model.kv_metadata.KVMetadata`, each stage builds from its
own :class:`~stagewise.kv.KVCacheManager`, whose block ids agree with every other stage's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass

import torch



def _fail(owner: str, name: str, value: object, expected: str) -> ValueError:
    return ValueError(f"{owner}.{name}: expected {expected}, got {value!r}")


@dataclass(kw_only=True, slots=True)
class StepBatch:
    """The requests of one step and the input of one stage (token ids or hidden states)."""

    request_ids: tuple[Hashable, ...]
    """One id per request, in row order (prefills first)."""
    num_prefills: int
    """The first ``num_prefills`` requests run their prompt or a chunk of it; the rest decode one token."""
    query_lens: tuple[int, ...]
    """Tokens of each request in this step: the prompt (chunk) length for a prefill, 1 for a decode."""
    context_lens: tuple[int, ...]
    """Tokens of each request already in the KV cache before this step (0 for a prompt's first chunk)."""
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
    """Last stage: logits of every token ``[T, vocab]`` instead of those of :meth:`logit_rows`."""
    last_chunk: tuple[bool, ...] | None = None
    """Per request: whether its tokens in this step end its prompt, so that the last stage samples
    its next token after them (True for every decode row; False for a prefill chunk that more of
    the prompt follows). None (the default): every request's."""
    mrope_positions: torch.Tensor | None = None
    """``[3, T]`` int64 (temporal, height, width) rope positions (Qwen3-VL); None: ``positions`` on all
    three axes. ``positions`` still says where each token's rope starts for text and decode rows."""
    pixel_values: torch.Tensor | None = None
    """``[patches, C * Tp * P * P]``: the images of the step's prefill rows, in row order (stage 0)."""
    image_grid_thw: torch.Tensor | None = None
    """``[images, 3]`` int64 (t, h, w) patch grid of each image of ``pixel_values``."""
    image_embeds: torch.Tensor | None = None
    """``[N, hidden]``: the vision tower's output for the step's image tokens, which replaces their
    embedding (stage 0, after :meth:`StageModel.encode_images`)."""
    visual_rows: torch.Tensor | None = None
    """``[N]`` int64: the rows of the step's image tokens (where ``image_embeds`` and the DeepStack
    features go)."""
    deepstack: torch.Tensor | None = None
    """``[levels, N, hidden]``: DeepStack features at ``visual_rows``; level ``i`` is added after the
    receiving stage's ``i``-th decoder layer (its first layer: level 0)."""
    prefix_blocks: tuple[tuple[int, ...], ...] | None = None
    """Per request, the cached blocks a request that starts in this step shares: a prefix-cache hit
    (:mod:`stagewise.kv.prefix`), its prefill starting after them; ``()`` for the others. None: no hit."""
    draft_tokens: tuple[tuple[int, ...], ...] | None = None
    """Per request, the draft tokens its row verifies (speculative decoding,
    :mod:`stagewise.engine.speculative`); ``()`` for the others. Such a row runs as a chunk after the
    request's cache (a prefill row): its last sampled token, then the drafts, and the last stage
    takes logits at every one of its tokens. None: no row verifies drafts."""

    def __post_init__(self) -> None:
        # Every stage makes one of these per step: the checks are written to cost little at batch 1.
        ids = self.request_ids = tuple(self.request_ids)
        q = self.query_lens = tuple(self.query_lens)
        c = self.context_lens = tuple(self.context_lens)
        r = len(ids)
        self.last_chunk = (True,) * r if self.last_chunk is None else tuple(map(bool, self.last_chunk))
        if r > 1 and len(set(ids)) != r:
            raise _fail("StepBatch", "request_ids", ids, "distinct ids")
        for name in ("query_lens", "context_lens", "last_chunk"):
            if len(getattr(self, name)) != r:
                raise _fail("StepBatch", name, getattr(self, name), f"{r} entries (one per request)")
        if not 0 <= self.num_prefills <= r:
            raise _fail("StepBatch", "num_prefills", self.num_prefills, f"an int in [0, {r}]")
        p = self.num_prefills
        if p and (min(q[:p]) < 1 or min(c[:p]) < 0):
            raise _fail("StepBatch", "query_lens/context_lens", (q[:p], c[:p]),
                        "prefill chunks of >= 1 token with context_lens >= 0")
        if p < r and (q[p:].count(1) != r - p or min(c[p:]) < 0):
            raise _fail("StepBatch", "query_lens/context_lens", (q[p:], c[p:]),
                        "decodes of exactly 1 token with context_lens >= 0")
        if not all(self.last_chunk[p:]):
            raise _fail("StepBatch", "last_chunk", self.last_chunk, "True for every decode row")
        t = sum(q)
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
        self._check_vision(t)
        drafts = self.draft_tokens
        if drafts is not None and (len(drafts) != r or any(
                d and (i >= p or not c[i] or q[i] != len(d) + 1 or not self.last_chunk[i]) for i, d in enumerate(drafts))):
            raise _fail("StepBatch", "draft_tokens", drafts, f"{r} tuples, empty but on rows of 1 + drafts tokens "
                        "after a request's cache (prefill rows that end its prompt)")
        hits = self.prefix_blocks
        if hits is not None and (len(hits) != r or any(h and (i >= p or not c[i]) for i, h in enumerate(hits))):
            raise _fail("StepBatch", "prefix_blocks", hits, f"{r} tuples, empty but on prefills after a cached prefix")

    def _check_vision(self, t: int) -> None:
        if self.mrope_positions is not None and self.mrope_positions.shape != (3, t):
            raise _fail("StepBatch", "mrope_positions", tuple(self.mrope_positions.shape), f"shape (3, {t})")
        if (self.pixel_values is None) != (self.image_grid_thw is None):
            raise _fail("StepBatch", "pixel_values/image_grid_thw", "one without the other", "both or neither")
        if self.pixel_values is not None:
            if self.token_ids is None or self.mrope_positions is None:
                raise _fail("StepBatch", "pixel_values", "images without token_ids and mrope_positions",
                            "images on stage 0's input, with 3-D positions")
            patches = int(self.image_grid_thw.prod(-1).sum()) if self.image_grid_thw.dim() == 2 else -1
            if self.pixel_values.dim() != 2 or self.pixel_values.size(0) != patches:
                raise _fail("StepBatch", "pixel_values", tuple(self.pixel_values.shape),
                            f"[patches, features] with the {patches} patches image_grid_thw counts")
        if self.visual_rows is None:
            if self.image_embeds is not None or self.deepstack is not None:
                raise _fail("StepBatch", "visual_rows", None, "the rows of image_embeds/deepstack")
            return
        if self.visual_rows.dim() != 1:
            raise _fail("StepBatch", "visual_rows", tuple(self.visual_rows.shape), "shape (N,)")
        n = self.visual_rows.numel()
        if self.image_embeds is not None and (self.image_embeds.dim() != 2 or self.image_embeds.size(0) != n):
            raise _fail("StepBatch", "image_embeds", tuple(self.image_embeds.shape), f"shape ({n}, hidden)")
        if self.deepstack is not None and (self.deepstack.dim() != 3 or self.deepstack.size(1) != n):
            raise _fail("StepBatch", "deepstack", tuple(self.deepstack.shape), f"shape (levels, {n}, hidden)")

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.query_lens[: self.num_prefills])

    def sampled_ids(self) -> tuple[Hashable, ...]:
        """The requests whose next token is sampled after this step, in row order."""
        return tuple(rid for rid, last in zip(self.request_ids, self.last_chunk) if last)

    def prefill_spans(self) -> list[tuple[int, int]]:
        """``(first_row, length)`` of each prefill request's tokens."""
        spans, start = [], 0
        for n in self.query_lens[: self.num_prefills]:
            spans.append((start, n))
            start += n
        return spans

    def cached_rows(self) -> list[int]:
        """Rows whose queries attend over the KV cache as decode rows do: every row of a prefill
        chunk after a prompt's first (the chunk sees the cached prompt and, causally, itself),
        then every decode row."""
        rows, start = [], 0
        for i, (ctx, n) in enumerate(zip(self.context_lens, self.query_lens)):
            if i >= self.num_prefills or ctx > 0:
                rows.extend(range(start, start + n))
            start += n
        return rows

    def last_token_rows(self) -> list[int]:
        """Row of each sampled request's last token (where its next token is sampled from)."""
        rows, end = [], 0
        for n, last in zip(self.query_lens, self.last_chunk):
            end += n
            if last:
                rows.append(end - 1)
        return rows

    def logit_rows(self) -> list[int]:
        """The rows the last stage takes logits at: each sampled request's last token, or every
        token of a row that verifies drafts (in row order)."""
        if self.draft_tokens is None:
            return self.last_token_rows()
        rows, end = [], 0
        for n, last, drafts in zip(self.query_lens, self.last_chunk, self.draft_tokens):
            end += n
            if drafts:
                rows.extend(range(end - n, end))
            elif last:
                rows.append(end - 1)
        return rows

    def for_next_stage(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None, *,
                       layers: int = 0) -> StepBatch:
        """The same step with this stage's output as the next stage's input; ``layers``: the decoder
        layers this stage ran, whose DeepStack levels are spent (none left: no image data goes on)."""
        deepstack = None if self.deepstack is None else self.deepstack[layers:]
        if deepstack is not None and deepstack.size(0) == 0:
            deepstack = None
        t = self.num_tokens
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 or hidden_states.size(0) != t:
            raise _fail("StepBatch.for_next_stage", "hidden_states", getattr(hidden_states, "shape", hidden_states),
                        f"a tensor of shape ({t}, hidden)")
        if residual is not None and residual.shape != hidden_states.shape:
            raise _fail("StepBatch.for_next_stage", "residual", tuple(residual.shape), "the shape of hidden_states")
        # A copy of the fields checked when this batch was made (once per stage and token, so
        # not through dataclasses.replace, which checks them all again).
        out = object.__new__(StepBatch)
        for name in _FIELDS:
            setattr(out, name, getattr(self, name))
        out.token_ids, out.hidden_states, out.residual = None, hidden_states, residual
        out.pixel_values = out.image_grid_thw = out.image_embeds = None
        out.deepstack, out.visual_rows = deepstack, None if deepstack is None else self.visual_rows
        return out


_FIELDS = tuple(f.name for f in dataclasses.fields(StepBatch))

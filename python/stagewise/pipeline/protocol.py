"""What crosses between the stages of a pipeline, as typed messages, and their one conversion to
and from :class:`~stagewise.transport.frame.Frame`.

Along the chain (stage i -> i + 1):

- :class:`Step`: one microbatch group's step: the :class:`~stagewise.model.batch.StepBatch`
  (rows and the previous stage's hidden states) and, for the requests that start in it, their
  sampling parameters as an opaque tensor: only the stage that samples decodes it, the stages
  in between forward it untouched;
- :class:`Free`: requests that ended on stage 0; every stage frees their KV;
- :class:`ResetKV`: every stage's block pools back to new (when no request holds KV), which puts
  them in step again after a step failed on some stages only (prefix caching names block ids that
  must mean the same on every stage);
- :class:`StepFailed`: a stage could not run a step; its requests end with the message.

A prefill row carries its chunk's first position (0 for a prompt's first chunk) and, on the chunk
that ends its prompt, ``LAST_PREFILL_CHUNK``. A step in which requests start after a cached prefix
carries their shared blocks (``StepBatch.prefix_blocks``) as tensors ``prefix_counts`` (per row)
and ``prefix_blocks`` (the ids, row after row); a step whose rows verify speculative drafts carries
them (``StepBatch.draft_tokens``) likewise as ``draft_counts`` and ``draft_tokens``, so that the last
stage can accept them and every stage can roll their KV back with the request's next step.

Back from the last stage to stage 0: :class:`Tokens` (the sampled tokens of each request of a step
that ends its prompt or decodes: one, or with drafts verified 1 to ``k + 1``, a row's
``num_tokens``; none for a chunk more of its prompt follows)
or :class:`StepFailed`. Every decode failure raises :class:`ProtocolError` naming what is wrong;
the receiving stage logs it and serves on.

A :class:`~stagewise.engine.handoff.KVHandoff` (one request's KV on one stage, or a rank's share
of it) travels as a ``KV_HANDOFF`` frame: :mod:`stagewise.pipeline.handoff_frames`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from stagewise.engine.step_sampling import Sampled
from stagewise.engine.params import SamplingParams, SamplingRequest, TokenLogprobs
from stagewise.int_tensors import int_tensor
from stagewise.model.batch import StepBatch
from stagewise.transport.frame import Frame, Row, RowFlags, StepKind

STEP_KINDS = (StepKind.PREFILL, StepKind.DECODE, StepKind.MIXED)
_PREFILL, _LAST_CHUNK = int(RowFlags.PREFILL), int(RowFlags.LAST_PREFILL_CHUNK)


class ProtocolError(ValueError):
    """A frame that does not fit the protocol or this stage; the message says why."""


@dataclass(kw_only=True, slots=True)
class Step:
    step_id: int
    group: int
    """The microbatch group (the frame's ``microbatch``)."""
    batch: StepBatch
    """Its ``hidden_states`` are the input of the receiving stage."""
    sampling: torch.Tensor | None = None
    """uint8 bytes of :func:`encode_sampling`, or None when no request starts in the step."""


@dataclass(kw_only=True, slots=True)
class Tokens:
    step_id: int
    group: int
    request_ids: list[int]
    tokens: list[int]
    """Every request's tokens, request after request."""
    logprobs: list[TokenLogprobs | None] | None = None
    """One entry per token where some request asked for logprobs (None: nobody did)."""
    counts: list[int] | None = None
    """Tokens of each request; None: one each."""


@dataclass(kw_only=True, slots=True)
class Free:
    request_ids: list[int]


@dataclass(kw_only=True, slots=True)
class ResetKV:
    pass


@dataclass(kw_only=True, slots=True)
class StepFailed:
    step_id: int
    group: int
    message: str


Message = Step | Tokens | Free | ResetKV | StepFailed


# ---- encoding ------------------------------------------------------------------------------

def to_frame(msg: Message, *, stage_from: int, stage_to: int) -> Frame:
    """The frame of ``msg`` from stage ``stage_from`` to ``stage_to``."""
    if isinstance(msg, Step):
        b = msg.batch
        p = b.num_prefills
        rows = [Row(int(rid), ctx, n, RowFlags.NONE if i >= p else
                    RowFlags.PREFILL | RowFlags.LAST_PREFILL_CHUNK if last else RowFlags.PREFILL)
                for i, (rid, ctx, n, last) in enumerate(zip(b.request_ids, b.context_lens, b.query_lens, b.last_chunk))]
        kind = StepKind.PREFILL if p == len(rows) else StepKind.DECODE if p == 0 else StepKind.MIXED
        # Stage 0's own steps carry token ids (to its other ranks); every later stage's, hidden states.
        tensors = {"hidden": b.hidden_states.contiguous()} if b.token_ids is None else {"token_ids": b.token_ids}
        tensors.update(_vision_tensors(b, rows))
        if msg.sampling is not None:
            tensors["sampling"] = msg.sampling
        if b.prefix_blocks is not None:
            tensors["prefix_counts"] = int_tensor([len(h) for h in b.prefix_blocks])
            tensors["prefix_blocks"] = int_tensor([block for h in b.prefix_blocks for block in h])
        if b.draft_tokens is not None:
            tensors["draft_counts"] = int_tensor([len(d) for d in b.draft_tokens])
            tensors["draft_tokens"] = int_tensor([t for d in b.draft_tokens for t in d])
        return Frame(step_kind=kind, step_id=msg.step_id, microbatch=msg.group, stage_from=stage_from,
                     stage_to=stage_to, token_index=max(r.first_position + r.num_tokens - 1 for r in rows),
                     rows=rows, tensors=tensors)
    if isinstance(msg, Tokens):
        tensors = {"token_ids": int_tensor(msg.tokens)}
        if msg.logprobs is not None:
            tensors["logprobs"] = _json_bytes([None if lp is None else [lp.token, lp.logprob, lp.top]
                                               for lp in msg.logprobs])
        return Frame(step_kind=StepKind.TOKENS, step_id=msg.step_id, microbatch=msg.group, stage_from=stage_from,
                     stage_to=stage_to, tensors=tensors,
                     rows=[Row(int(r), 0, n) for r, n in zip(msg.request_ids, msg.counts or [1] * len(msg.request_ids),
                                                             strict=True)])
    if isinstance(msg, Free):
        return Frame(step_kind=StepKind.CONTROL, stage_from=stage_from, stage_to=stage_to,
                     rows=[Row(int(r), 0, 0, RowFlags.FINISHED) for r in msg.request_ids], control={"op": "free"})
    if isinstance(msg, ResetKV):
        return Frame(step_kind=StepKind.CONTROL, stage_from=stage_from, stage_to=stage_to, control={"op": "reset_kv"})
    if isinstance(msg, StepFailed):
        return Frame(step_kind=StepKind.CONTROL, step_id=msg.step_id, microbatch=msg.group, stage_from=stage_from,
                     stage_to=stage_to, control={"op": "step_failed", "message": msg.message})
    raise TypeError(f"pipeline.protocol.to_frame: not a pipeline message: {type(msg).__name__}")


def _vision_tensors(b: StepBatch, rows: list[Row]) -> dict[str, torch.Tensor]:
    """A Qwen3-VL step's named extra tensors: ``positions`` when a row's rope position is not its
    cache position (a request whose images shifted its text positions), ``mrope_positions`` with an
    image prefill, and ``visual_rows`` with the DeepStack levels the receiver's layers still add
    (``image_embeds`` too on stage 0's steps to its other ranks)."""
    if b.pixel_values is not None:
        raise ValueError("pipeline.protocol: a step still holding pixel_values cannot be sent; stage 0 "
                         "encodes its images first (StageModel.encode_images)")
    out = {}
    given, at = b.positions.tolist(), 0  # one call: a decode step's every tensor op costs (cold caches)
    for r in rows:
        n = r.num_tokens
        if given[at : at + n] != list(range(r.first_position, r.first_position + n)):
            out["positions"] = b.positions
            break
        at += n
    for name in ("mrope_positions", "visual_rows", "image_embeds", "deepstack"):
        value = getattr(b, name)
        if value is not None:
            out[name] = value.contiguous()
    return out


def tokens_message(step_id: int, group: int, request_ids: Sequence[int], sampled: Sampled) -> Tokens:
    """The last stage's answer to a step (its tokens on any device)."""
    return Tokens(step_id=step_id, group=group, request_ids=list(request_ids), tokens=sampled.tokens.tolist(),
                  logprobs=sampled.logprobs, counts=sampled.counts)


# ---- decoding ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StageShape:
    """What a stage accepts: its index and the hidden states it takes."""

    index: int
    hidden_size: int
    dtype: torch.dtype
    max_model_len: int
    device: torch.device


def from_frame(frame: Frame, stage: StageShape | None) -> Message:
    """The message a frame carries to ``stage`` (None: a link that carries no steps, such as
    the feedback link into stage 0); ProtocolError when it does not fit."""
    kind = frame.step_kind
    if kind == StepKind.CONTROL:
        op = (frame.control or {}).get("op")
        if op == "free":
            return Free(request_ids=[r.request_id for r in frame.rows])
        if op == "reset_kv":
            return ResetKV()
        if op == "step_failed":
            message = (frame.control or {}).get("message")
            if not isinstance(message, str):
                raise ProtocolError(f"step_failed: message must be a string, got {message!r}")
            return StepFailed(step_id=frame.step_id, group=frame.microbatch, message=message)
        raise ProtocolError(f"control op {op!r} is not a pipeline message (expected 'free', 'reset_kv' or 'step_failed')")
    if kind == StepKind.TOKENS:
        ids = frame.tensors.get("token_ids")
        rids, counts = [r.request_id for r in frame.rows], [r.num_tokens for r in frame.rows]
        n = sum(counts)
        if counts and min(counts) < 1:
            raise ProtocolError(f"rows: every request of a Tokens frame has at least one token, got {counts[:8]}")
        if ids is None or tuple(ids.shape) != (n,) or ids.dtype != torch.int64:
            raise ProtocolError(f"tensors['token_ids']: expected int64 of shape ({n},), got "
                                f"{None if ids is None else (tuple(ids.shape), ids.dtype)}")
        logprobs = None
        if "logprobs" in frame.tensors:
            logprobs = _logprobs(_from_json_bytes(frame.tensors["logprobs"], "logprobs"), n)
        return Tokens(step_id=frame.step_id, group=frame.microbatch, request_ids=rids, tokens=ids.tolist(),
                      logprobs=logprobs, counts=None if n == len(rids) else counts)
    if kind in STEP_KINDS and stage is not None:
        return _step(frame, stage)
    raise ProtocolError(f"step_kind {kind!r} is not a pipeline message")


def _step(frame: Frame, stage: StageShape) -> Step:
    if frame.stage_to != stage.index:
        raise ProtocolError(f"stage_to is {frame.stage_to}, this is stage {stage.index}")
    rows = frame.rows
    if not rows:
        raise ProtocolError("rows: a step needs at least one row")
    tokens = sum(r.num_tokens for r in rows)
    hidden, token_ids = frame.tensors.get("hidden"), None
    if stage.index == 0 and "token_ids" in frame.tensors:
        token_ids = frame.tensors["token_ids"]
        if tuple(token_ids.shape) != (tokens,) or token_ids.dtype != torch.int64:
            raise ProtocolError(f"tensors['token_ids']: expected int64 of shape ({tokens},), got "
                                f"{(tuple(token_ids.shape), token_ids.dtype)}")
    else:
        want = (tokens, stage.hidden_size)
        if hidden is None or tuple(hidden.shape) != want:
            raise ProtocolError(f"tensors['hidden']: expected shape {want}, got "
                                f"{None if hidden is None else tuple(hidden.shape)}")
        if hidden.dtype != stage.dtype:
            raise ProtocolError(f"tensors['hidden']: expected dtype {stage.dtype}, got {hidden.dtype}")
    sampling = frame.tensors.get("sampling")
    if sampling is not None and (sampling.dtype != torch.uint8 or sampling.dim() != 1):
        raise ProtocolError(f"tensors['sampling']: expected uint8 bytes, got {sampling.dtype} {tuple(sampling.shape)}")
    positions, last_chunk, num_prefills, seen_decode = [], [], 0, False
    for i, r in enumerate(rows):
        flags, first, n = int(r.flags), r.first_position, r.num_tokens  # int: no IntFlag arithmetic per row
        prefill = bool(flags & _PREFILL)
        if n < 1 or (not prefill and n != 1):
            raise ProtocolError(f"rows[{i}]: {n} tokens from position {first} (prefill={prefill})")
        if not prefill and flags & _LAST_CHUNK:
            raise ProtocolError(f"rows[{i}]: LAST_PREFILL_CHUNK on a decode row")
        if prefill and seen_decode:
            raise ProtocolError(f"rows[{i}]: prefill rows must come before decode rows")
        if first + n > stage.max_model_len:
            raise ProtocolError(f"rows[{i}]: position {first + n} beyond max_model_len {stage.max_model_len}")
        seen_decode |= not prefill
        num_prefills += prefill
        last_chunk.append(not prefill or bool(flags & _LAST_CHUNK))
        if n == 1:
            positions.append(first)
        else:
            positions.extend(range(first, first + n))
    device = stage.device
    hits = _counted(frame.tensors, "prefix", len(rows)) if "prefix_counts" in frame.tensors else None
    drafts = _counted(frame.tensors, "draft", len(rows)) if "draft_counts" in frame.tensors else None
    known = 1 + (sampling is not None) + 2 * (hits is not None) + 2 * (drafts is not None)
    extra = _vision_extras(frame.tensors, tokens, stage) if len(frame.tensors) > known else {}
    given = extra.pop("positions", None)
    batch = StepBatch(request_ids=[r.request_id for r in rows], num_prefills=num_prefills,
                      query_lens=[r.num_tokens for r in rows], context_lens=[r.first_position for r in rows],
                      last_chunk=last_chunk,
                      positions=given if given is not None else int_tensor(positions, device=device),
                      token_ids=None if token_ids is None else token_ids.to(device),
                      hidden_states=None if hidden is None else hidden.to(device), prefix_blocks=hits,
                      draft_tokens=drafts, **extra)
    return Step(step_id=frame.step_id, group=frame.microbatch, batch=batch, sampling=sampling)


def _counted(tensors: Mapping[str, torch.Tensor], name: str, num_rows: int) -> tuple[tuple[int, ...], ...]:
    """A step's ``prefix_counts`` and ``prefix_blocks`` back as :attr:`StepBatch.prefix_blocks`, or
    its ``draft_counts`` and ``draft_tokens`` as :attr:`StepBatch.draft_tokens`."""
    items = "blocks" if name == "prefix" else "tokens"
    counts, ids = tensors[f"{name}_counts"], tensors.get(f"{name}_{items}")
    if counts.dtype != torch.int64 or tuple(counts.shape) != (num_rows,) or ids is None or ids.dtype != torch.int64 \
            or ids.dim() != 1 or int(counts.sum()) != ids.numel() or (num_rows and int(counts.min()) < 0):
        raise ProtocolError(f"tensors['{name}_counts'/'{name}_{items}']: expected int64 counts for {num_rows} rows and "
                            f"as many int64 ids as they add up to, got {counts.tolist()!r:.80} and "
                            f"{None if ids is None else tuple(ids.shape)}")
    flat, out, at = ids.tolist(), [], 0
    for n in counts.tolist():
        out.append(tuple(flat[at:at + n]))
        at += n
    return tuple(out)


def _vision_extras(tensors: Mapping[str, torch.Tensor], tokens: int, stage: StageShape) -> dict[str, torch.Tensor]:
    """The Qwen3-VL tensors of a step frame (see :func:`_vision_tensors`), checked and on the stage's device."""
    out = {}
    n = None if "visual_rows" not in tensors else tensors["visual_rows"].numel()
    want = {"positions": ((tokens,), torch.int64), "mrope_positions": ((3, tokens), torch.int64),
            "visual_rows": ((n,), torch.int64), "image_embeds": ((n, stage.hidden_size), stage.dtype)}
    for name, (shape, dtype) in want.items():
        t = tensors.get(name)
        if t is None:
            continue
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ProtocolError(f"tensors[{name!r}]: expected {dtype} of shape {shape}, got "
                                f"{(tuple(t.shape), t.dtype)}")
        out[name] = t.to(stage.device)
    deepstack = tensors.get("deepstack")
    if deepstack is not None:
        if deepstack.dim() != 3 or tuple(deepstack.shape[1:]) != (n, stage.hidden_size) or deepstack.dtype != stage.dtype:
            raise ProtocolError(f"tensors['deepstack']: expected {stage.dtype} of shape (levels, {n}, "
                                f"{stage.hidden_size}) with visual_rows, got {(tuple(deepstack.shape), deepstack.dtype)}")
        out["deepstack"] = deepstack.to(stage.device)
    if ("image_embeds" in out or "deepstack" in out) != ("visual_rows" in out):
        raise ProtocolError("tensors['visual_rows']: sent with image_embeds or deepstack, and only with them")
    rows = out.get("visual_rows")
    if rows is not None and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= tokens):
        raise ProtocolError(f"tensors['visual_rows']: rows must lie in [0, {tokens})")
    return out


# ---- sampling parameters and logprobs: bytes only the last stage (or stage 0) decodes ----------

def encode_sampling(requests: Mapping[int, SamplingRequest]) -> torch.Tensor | None:
    """What the last stage needs of a step's new requests, as uint8 bytes (UTF-8 JSON), or None."""
    if not requests:
        return None
    return _json_bytes({str(int(rid)): {"params": dataclasses.asdict(r.params), "prompt_ids": list(r.prompt_ids),
                                        "output_ids": list(r.output_ids)} for rid, r in requests.items()})


def decode_sampling(data: torch.Tensor | None) -> dict[int, SamplingRequest]:
    """:func:`encode_sampling`'s requests back; ProtocolError naming the bad request."""
    if data is None:
        return {}
    table = _from_json_bytes(data, "sampling")
    if not isinstance(table, dict):
        raise ProtocolError(f"tensors['sampling']: expected a JSON object, got {type(table).__name__}")
    out = {}
    for key, entry in table.items():
        try:
            ids = {name: entry.get(name, []) for name in ("prompt_ids", "output_ids")}
            for name, value in ids.items():
                if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
                    raise ValueError(f"{name} must be a list of ints, got {value!r:.80}")
            out[int(key)] = SamplingRequest(SamplingParams(**entry["params"]), tuple(ids["prompt_ids"]),
                                            tuple(ids["output_ids"]))
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise ProtocolError(f"tensors['sampling'][{key!r}]: {err}") from None
    return out


def _logprobs(rows, n: int) -> list[TokenLogprobs | None]:
    if not isinstance(rows, list) or len(rows) != n:
        raise ProtocolError(f"tensors['logprobs']: expected a list of {n} entries")
    out = []
    for i, row in enumerate(rows):
        if row is None:
            out.append(None)
            continue
        try:
            token, logprob, top = row
            out.append(TokenLogprobs(token=int(token), logprob=float(logprob),
                                     top=tuple((int(t), float(v)) for t, v in top)))
        except (TypeError, ValueError) as err:
            raise ProtocolError(f"tensors['logprobs'][{i}]: expected [token, logprob, [[token, logprob], ...]] "
                                f"({err})") from None
    return out


def _json_bytes(value) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value, separators=(",", ":")).encode()), dtype=torch.uint8)


def _from_json_bytes(data: torch.Tensor, name: str):
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ProtocolError(f"tensors[{name!r}]: expected uint8 bytes, got {data.dtype} {tuple(data.shape)}")
    try:
        return json.loads(bytes(data.cpu().numpy()).decode())
    except (UnicodeDecodeError, ValueError) as err:
        raise ProtocolError(f"tensors[{name!r}]: not UTF-8 JSON ({err})") from None

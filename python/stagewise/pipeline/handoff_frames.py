"""A :class:`~stagewise.engine.handoff.KVHandoff` (one request's KV on one stage, or a rank's share
of it) as a ``KV_HANDOFF`` frame, and back."""

from __future__ import annotations

import dataclasses

import torch

from stagewise.engine.handoff import KVHandoff, KVShard, tensor_fields
from stagewise.engine.params import SamplingParams
from stagewise.pipeline.protocol import ProtocolError
from stagewise.transport.frame import Frame, StepKind


def handoff_frame(handoff: KVHandoff, *, stage: int) -> Frame:
    """The frame of one request's KV on ``stage`` (or one rank's share of it): tensors ``k`` and
    ``v`` (a compact cache's codes, with ``k_scale`` and ``v_scale``; e4m3 codes travel as their
    bytes, ``control['kv_codes']`` naming them) and the generator's state on the last stage; the layer
    range, the share and the sampling parameters in ``control``; the request in ``request_id`` and its
    cached tokens in ``token_index``."""
    fp8 = handoff.k.dtype == torch.float8_e4m3fn
    tensors = {n: t.view(torch.uint8) if fp8 and n in "kv" else t for n, t in tensor_fields(handoff.tensors).items()}
    if handoff.generator_state is not None:
        tensors["generator_state"] = handoff.generator_state
    control = {"layers": list(handoff.layers)}
    if fp8:
        control["kv_codes"] = "float8_e4m3fn"
    if handoff.shard is not None:
        control["shard"] = {**dataclasses.asdict(handoff.shard), "kv_heads": list(handoff.shard.kv_heads)}
    if handoff.sampling is not None:
        control["sampling"] = dataclasses.asdict(handoff.sampling)
    if handoff.history is not None:
        control["history"] = [list(handoff.history[0]), list(handoff.history[1])]
    return Frame(step_kind=StepKind.KV_HANDOFF, request_id=int(handoff.request_id), stage_from=stage, stage_to=stage,
                 token_index=handoff.num_tokens, tensors=tensors, control=control)


def handoff_from_frame(frame: Frame) -> KVHandoff:
    """A KV handoff back from its frame; ProtocolError when the frame is not one."""
    if frame.step_kind != StepKind.KV_HANDOFF:
        raise ProtocolError(f"expected a KV_HANDOFF frame, got {frame.step_kind!r}")
    control = frame.control or {}
    layers = control.get("layers")
    if not (isinstance(layers, list) and len(layers) == 2 and all(isinstance(x, int) for x in layers)):
        raise ProtocolError(f"control['layers']: expected [start, end], got {layers!r}")
    shard = control.get("shard")
    try:
        shard = None if shard is None else KVShard(**{**shard, "kv_heads": tuple(shard["kv_heads"])})
    except (TypeError, ValueError, KeyError) as err:
        raise ProtocolError(f"control['shard']: {err}") from None
    sampling = control.get("sampling")
    try:
        params = None if sampling is None else SamplingParams(**sampling)
    except (TypeError, ValueError) as err:
        raise ProtocolError(f"control['sampling']: {err}") from None
    history = control.get("history")
    if history is not None and not (isinstance(history, list) and len(history) == 2
                                    and all(isinstance(h, list) for h in history)):
        raise ProtocolError(f"control['history']: expected [prompt tokens, generated tokens], got {history!r:.80}")
    k, v = frame.tensors.get("k"), frame.tensors.get("v")
    if k is None or v is None:
        raise ProtocolError(f"tensors 'k'/'v': a KV_HANDOFF frame carries both, got {sorted(frame.tensors)}")
    codes = control.get("kv_codes")
    if codes is not None:
        if codes != "float8_e4m3fn" or k.dtype != torch.uint8 or v.dtype != torch.uint8:
            raise ProtocolError(f"control['kv_codes']: float8_e4m3fn codes travel as uint8, got {codes!r} with "
                                f"{k.dtype} k")
        k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
    try:
        return KVHandoff(request_id=frame.request_id, layers=(layers[0], layers[1]), num_tokens=frame.token_index,
                         k=k, v=v, k_scale=frame.tensors.get("k_scale"), v_scale=frame.tensors.get("v_scale"),
                         shard=shard, sampling=params, generator_state=frame.tensors.get("generator_state"),
                         history=None if history is None else (history[0], history[1]))
    except ValueError as err:
        raise ProtocolError(f"tensors 'k'/'v': {err}") from None

"""KV handoff (seed 000 §2.2): one request's KV for one stage as a frame, so that another
instance of the same stage (a restarted or stateless stage, a validation run) continues the
request where this one left off.

The frame (``StepKind.KV_HANDOFF``) names the request in ``request_id`` and its cached
tokens in ``token_index`` (no row table); its tensors are ``"k"`` and ``"v"``, each
``[num_layers, num_tokens, num_kv_heads, head_dim]`` in the cache dtype, gathered from the
request's blocks in position order; ``control`` carries the stage's layer range and, on the
last stage, the request's sampling parameters and generator state (so seeded sampling goes on
exactly as it would have).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import torch

from stagewise.runtime.sampling import SamplingParams, make_generator
from stagewise.transport.frame import Frame, StepKind


def export_kv(runtime, request_id: Hashable, *, stage: int = 0) -> Frame:
    """The KV of ``request_id`` held by ``runtime`` (a :class:`StageRuntime`) as a frame."""
    manager, cache = runtime.manager, runtime.kv_cache
    if request_id not in manager:
        raise ValueError(f"export_kv: this stage holds no KV for request {request_id!r}")
    n = manager.num_tokens(request_id)
    blocks = torch.tensor(manager.block_ids(request_id), dtype=torch.int64, device=cache.storage.device)
    # storage [L, 2, num_blocks, block, Hk, D] -> the request's blocks -> [L, 2, n, Hk, D]
    kv = cache.storage.index_select(2, blocks).flatten(2, 3)[:, :, :n]
    spec = cache.spec
    control = {"layers": [spec.layer_start, spec.layer_end], "num_tokens": n}
    sampling = getattr(runtime, "_sampling", {}).get(request_id)
    if sampling is not None:
        params, generator = sampling
        control["sampling"] = dataclasses.asdict(params)
        if generator is not None:
            control["generator_state"] = generator.get_state().tolist()
    return Frame(step_kind=StepKind.KV_HANDOFF, request_id=int(request_id), stage_from=stage, stage_to=stage,
                 token_index=n,
                 tensors={"k": kv[:, 0].contiguous().cpu(), "v": kv[:, 1].contiguous().cpu()}, control=control)


def import_kv(runtime, frame: Frame) -> None:
    """Take over the request of a KV-handoff frame: allocate its blocks here and copy its K/V
    in. ValueError (nothing changed) if the frame does not fit this stage."""
    if frame.step_kind != StepKind.KV_HANDOFF:
        raise ValueError(f"import_kv: expected a KV_HANDOFF frame, got {frame.step_kind!r}")
    control = frame.control or {}
    spec, manager, cache = runtime.kv_cache.spec, runtime.manager, runtime.kv_cache
    if control.get("layers") != [spec.layer_start, spec.layer_end]:
        raise ValueError(f"import_kv: the frame holds layers {control.get('layers')}, this stage "
                         f"[{spec.layer_start}, {spec.layer_end})")
    rid, n = frame.request_id, int(control.get("num_tokens", -1))
    want = (spec.num_layers, n, spec.num_kv_heads, spec.head_dim)
    for name in ("k", "v"):
        t = frame.tensors.get(name)
        if t is None or tuple(t.shape) != want or t.dtype != spec.dtype:
            raise ValueError(f"import_kv: tensor {name!r} must be {want} {spec.dtype}, got "
                             f"{None if t is None else (tuple(t.shape), t.dtype)}")
    if rid in manager:
        raise ValueError(f"import_kv: request {rid} already has KV on this stage")
    manager.add(rid, n)
    try:
        blocks = torch.tensor(manager.block_ids(rid), dtype=torch.int64, device=cache.storage.device)
        size = manager.block_size
        for j, name in enumerate(("k", "v")):
            src = frame.tensors[name].to(cache.storage.device)
            padded = torch.zeros((spec.num_layers, len(blocks) * size, spec.num_kv_heads, spec.head_dim),
                                 dtype=spec.dtype, device=cache.storage.device)
            padded[:, :n] = src
            cache.storage[:, j].index_copy_(1, blocks, padded.unflatten(1, (len(blocks), size)))
        if "sampling" in control and runtime.is_last:
            params = SamplingParams(**control["sampling"])
            generator = make_generator(params, runtime.device)
            if generator is not None and "generator_state" in control:
                generator.set_state(torch.tensor(control["generator_state"], dtype=torch.uint8))
            runtime._sampling[rid] = (params, generator)
    except Exception:
        manager.free(rid)
        raise

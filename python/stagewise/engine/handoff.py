"""One request's KV on one stage, as it leaves one instance of the stage and joins another
(:class:`KVHandoff`), and the shares of it that the ranks of a stage of several ranks hold.

A rank of a stage holds a request's K/V for its KV heads (tensor parallel: the heads split, or
replicated when TP exceeds them) and, with context parallelism, for the positions its
``cp_rank`` owns in the interleaved slot mapping: position ``p`` lives on CP rank
``(p // interleave_size) % cp_world_size``, and each rank fills its local slots in position
order, whatever the block size (``docs/parallel.md``). So a rank's share is
``K[:, owned positions, its heads]``: :class:`KVShard` names it, :func:`split_handoff` cuts it out of
a whole handoff and :func:`merge_handoffs` puts the shares of every rank back together. A request
can thus move between two stages of the same layout rank by rank, or between layouts through the
whole handoff (e.g. out of a ``tp=2, dcp=2`` stage into a stage of one process).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from stagewise.engine.params import SamplingParams
from stagewise.kv import KVCache, KVCacheManager
from stagewise.kv.cache import KV_CACHE_DTYPES, KVCacheSpec
from stagewise.ops.reference import dequantise_kv, quantise_kv


@dataclass(kw_only=True, frozen=True, slots=True)
class KVShard:
    """The share of a request's KV that one rank of a stage of several ranks holds."""

    kv_heads: tuple[int, int]
    """The model's KV heads ``[first, end)`` this rank holds."""
    num_kv_heads: int
    """The model's KV heads (every rank's share is a part of these)."""
    cp_world_size: int = 1
    """Ranks sharing one KV head's sequence (``pcp * dcp``)."""
    cp_rank: int = 0
    interleave_size: int = 1

    def __post_init__(self) -> None:
        a, b = self.kv_heads
        if not 0 <= a < b <= self.num_kv_heads:
            raise ValueError(f"KVShard: kv_heads {list(self.kv_heads)} must be a range within the model's "
                             f"{self.num_kv_heads} KV heads")
        if self.cp_world_size < 1 or not 0 <= self.cp_rank < self.cp_world_size or self.interleave_size < 1:
            raise ValueError(f"KVShard: cp_rank {self.cp_rank} of cp_world_size {self.cp_world_size} with "
                             f"interleave_size {self.interleave_size} is not a context-parallel place")

    def positions(self, num_tokens: int) -> torch.Tensor:
        """The positions (of ``num_tokens``) this rank stores, in the order of its local slots."""
        p = torch.arange(num_tokens)
        return p[(p // self.interleave_size) % self.cp_world_size == self.cp_rank]

    def layout(self) -> tuple[int, int, int]:
        """What two shares must agree on to be parts of one whole."""
        return self.num_kv_heads, self.cp_world_size, self.interleave_size


TENSOR_FIELDS = ("k", "v", "k_scale", "v_scale")
"""A handoff's tensors in the order :attr:`KVHandoff.tensors` and :func:`read_kv` give them."""


def tensor_fields(tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``k, v`` (and a compact cache's scales) as a handoff's keyword arguments."""
    return dict(zip(TENSOR_FIELDS, tensors))


@dataclass(kw_only=True, slots=True)
class KVHandoff:
    """One request's KV on one stage (or one rank's share of it)."""

    request_id: int
    layers: tuple[int, int]
    """The stage's layer range ``[start, end)``."""
    num_tokens: int
    """The request's tokens in the cache (of which a share holds those of its positions)."""
    k: torch.Tensor
    """``[num_layers, tokens held, Hk held, D]`` in the cache dtype (a compact cache's codes), in
    position order (a sliding-window layer: zeros before the positions its window still reaches)."""
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    """A compact cache's float16 scales ``[num_layers, tokens held, Hk held]``; None otherwise."""
    v_scale: torch.Tensor | None = None
    shard: KVShard | None = None
    """Which share of the KV this is; None: the whole of it (every KV head, every position)."""
    sampling: SamplingParams | None = None
    """Last stage: the request's sampling parameters."""
    generator_state: torch.Tensor | None = None
    """Last stage: the state of the request's seeded generator (uint8)."""
    history: tuple[list[int], list[int]] | None = None
    """Last stage, with a penalty: the (prompt, generated) tokens its penalties count."""

    def __post_init__(self) -> None:
        held = self.num_tokens if self.shard is None else len(self.shard.positions(self.num_tokens))
        heads = None if self.shard is None else self.shard.kv_heads[1] - self.shard.kv_heads[0]
        for name, t in (("k", self.k), ("v", self.v)):
            if t.dim() != 4 or t.size(1) != held or (heads is not None and t.size(2) != heads):
                raise ValueError(f"KVHandoff: request {self.request_id}: {name!r} must be [layers, {held}, "
                                 f"{heads or 'heads'}, dim] for {self.num_tokens} tokens"
                                 f"{'' if self.shard is None else f' in the share {self.shard}'}, "
                                 f"got {tuple(t.shape)}")
        if self.k.shape != self.v.shape:
            raise ValueError(f"KVHandoff: request {self.request_id}: 'k' {tuple(self.k.shape)} and 'v' "
                             f"{tuple(self.v.shape)} differ")
        compact = self.k.dtype in (torch.int8, torch.float8_e4m3fn)
        for name, t in (("k_scale", self.k_scale), ("v_scale", self.v_scale)):
            if (t is None) == compact or (t is not None and (t.shape != self.k.shape[:3] or t.dtype != torch.float16)):
                raise ValueError(f"KVHandoff: request {self.request_id}: {name!r} must be "
                                 + (f"float16 {tuple(self.k.shape[:3])} beside {self.k.dtype} codes" if compact
                                    else f"None beside {self.k.dtype} K/V")
                                 + f", got {None if t is None else (tuple(t.shape), t.dtype)}")

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``k, v`` and, for a compact cache, their scales: what travels, indexed alike by
        ``[layer, token, head]``."""
        return (self.k, self.v) if self.k_scale is None else (self.k, self.v, self.k_scale, self.v_scale)

    def in_cache_dtype(self, spec: KVCacheSpec) -> KVHandoff:
        """This handoff in the values a cache of ``spec`` stores: as it is, or dequantised and
        quantised again (a row quantised by itself, so a compact cache's codes come back the same
        after any number of such trips)."""
        if self.k.dtype == spec.code_dtype:
            return self
        k, v = (t.float() if self.k_scale is None else dequantise_kv(t, s)
                for t, s in ((self.k, self.k_scale), (self.v, self.v_scale)))
        if not spec.compact:
            return replace(self, k=k.to(spec.dtype), v=v.to(spec.dtype), k_scale=None, v_scale=None)
        (k, k_scale), (v, v_scale) = (quantise_kv(t, KV_CACHE_DTYPES[spec.kv_cache_dtype]) for t in (k, v))
        return replace(self, k=k, v=v, k_scale=k_scale, v_scale=v_scale)


def _group_layers(cache: KVCache, group: int) -> list[int]:
    """The stage-local indices of the layers of ``group``, in order."""
    return [i for i, g in enumerate(cache.layer_group) if g == group]


def read_kv(managers: Sequence[KVCacheManager], cache: KVCache, request_id,
            num_held: int) -> tuple[torch.Tensor, ...]:
    """The first ``num_held`` local slots of a request in every layer: ``k, v [layers, num_held, Hk, D]``
    (one manager per layer group of ``cache``), and a compact cache's scales ``[layers, num_held, Hk]``
    after them. A sliding-window layer holds the positions its window still reaches; the earlier ones,
    which it gave back and no query reads, are zeros."""
    spec = cache.spec
    out = [torch.zeros((spec.num_layers, num_held, spec.num_kv_heads, spec.head_dim), dtype=spec.code_dtype)
           for _ in range(2)]
    if spec.compact:
        out += [torch.zeros((spec.num_layers, num_held, spec.num_kv_heads), dtype=torch.float16) for _ in range(2)]
    for group, manager in enumerate(managers):
        kept = manager.kept_from(request_id)
        base = kept // spec.block_size * spec.block_size
        blocks = torch.tensor(manager.block_ids(request_id)[kept // spec.block_size:], dtype=torch.int64,
                              device=cache.storages[group].device)
        layers = _group_layers(cache, group)
        for j, storage in enumerate(cache.group_tensors(group)):
            # storage [Lg, 2, num_blocks, block, Hk(, D)] -> the request's blocks -> [Lg, 2, slots, Hk(, D)]
            kv = storage.index_select(2, blocks).flatten(2, 3)[:, :, kept - base:num_held - base].cpu()
            out[2 * j][layers, kept:num_held], out[2 * j + 1][layers, kept:num_held] = kv[:, 0], kv[:, 1]
    return tuple(out)


def write_kv(managers: Sequence[KVCacheManager], cache: KVCache, request_id, *tensors: torch.Tensor) -> None:
    """The inverse of :func:`read_kv`: ``k, v`` (and a compact cache's ``k_scale, v_scale``) into the
    request's blocks (a sliding-window layer takes the positions its window reaches)."""
    spec = cache.spec
    held = tensors[0].size(1)
    for group, manager in enumerate(managers):
        kept = manager.kept_from(request_id)
        base = kept // spec.block_size * spec.block_size
        blocks = torch.tensor(manager.block_ids(request_id)[kept // spec.block_size:], dtype=torch.int64,
                              device=cache.storages[group].device)
        layers = _group_layers(cache, group)
        for j, storage in enumerate(cache.group_tensors(group)):
            # e4m3 codes are copied as their bytes (torch has no index_copy of float8 on the CPU)
            as_bytes = storage.dtype == torch.float8_e4m3fn
            storage = storage.view(torch.uint8) if as_bytes else storage
            padded = torch.zeros((len(layers), len(blocks) * spec.block_size, *storage.shape[4:]),
                                 dtype=storage.dtype, device=storage.device)
            for i in range(2):
                part = tensors[2 * j + i][layers, kept:held]
                padded[:, kept - base:held - base] = (part.view(torch.uint8) if as_bytes else part).to(storage.device)
                storage[:, i].index_copy_(1, blocks, padded.unflatten(1, (len(blocks), spec.block_size)))


def split_handoff(whole: KVHandoff, shard: KVShard) -> KVHandoff:
    """The share ``shard`` of a whole handoff (with the sampling state, which only a stage's
    leader uses)."""
    if whole.shard is not None:
        raise ValueError(f"split_handoff: request {whole.request_id}: the handoff is already the share "
                         f"{whole.shard}; merge_handoffs first")
    if whole.k.size(2) != shard.num_kv_heads:
        raise ValueError(f"split_handoff: request {whole.request_id}: the handoff has {whole.k.size(2)} KV heads, "
                         f"the share {shard} is of {shard.num_kv_heads}")
    pos, (a, b) = shard.positions(whole.num_tokens), shard.kv_heads
    cut = [t[:, pos, a:b].contiguous() for t in whole.tensors]
    return replace(whole, **tensor_fields(cut), shard=shard)


def merge_handoffs(shares: Sequence[KVHandoff]) -> KVHandoff:
    """The whole handoff from the shares of every rank of a stage (shares of the same part, as on
    ranks that replicate a KV head, are taken once). ValueError naming the missing heads and CP
    ranks, or the share that does not belong."""
    if not shares:
        raise ValueError("merge_handoffs: no shares")
    first = shares[0]
    if any(s.shard is None for s in shares):
        if len(shares) == 1:
            return first
        raise ValueError(f"merge_handoffs: request {first.request_id}: a whole handoff among several shares")
    layout = first.shard.layout()
    for s in shares:
        if (s.request_id, tuple(s.layers), s.num_tokens, s.shard.layout()) != (
                first.request_id, tuple(first.layers), first.num_tokens, layout):
            raise ValueError(f"merge_handoffs: the share {s.shard} of request {s.request_id} (layers "
                             f"{list(s.layers)}, {s.num_tokens} tokens) is not a part of request "
                             f"{first.request_id} (layers {list(first.layers)}, {first.num_tokens} tokens, "
                             f"KV heads / cp_world_size / interleave_size {layout})")
    num_heads, cp, _ = layout
    whole = [torch.empty((t.size(0), first.num_tokens, num_heads, *t.shape[3:]), dtype=t.dtype)
             for t in first.tensors]
    covered = torch.zeros((num_heads, cp), dtype=torch.bool)
    for s in shares:
        (a, b), r = s.shard.kv_heads, s.shard.cp_rank
        pos = s.shard.positions(s.num_tokens)
        if len(s.tensors) != len(whole) or s.k.dtype != first.k.dtype:
            raise ValueError(f"merge_handoffs: request {first.request_id}: the share {s.shard} holds {s.k.dtype} K/V, "
                             f"another {first.k.dtype}")
        for dst, src in zip(whole, s.tensors):
            dst[:, pos, a:b] = src
        covered[a:b, r] = True
    if not bool(covered.all()):
        missing = [tuple(x) for x in torch.nonzero(~covered).tolist()]
        raise ValueError(f"merge_handoffs: request {first.request_id}: no share holds (KV head, cp_rank) "
                         f"{missing[:8]}")
    leader = next((s for s in shares if s.sampling is not None), first)
    return replace(first, **tensor_fields(whole), shard=None, sampling=leader.sampling,
                   generator_state=leader.generator_state, history=leader.history)

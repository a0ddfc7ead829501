"""Context-parallel attention: the cached sequence of each KV head sharded over the
``cp = pcp * dcp`` ranks that hold that head, with the interleaved slot mapping of
:func:`stagewise.ops.slot_mapping` (``docs/parallel.md`` has a worked example).

- **Decode** (every CP rank runs the same decode rows): the query heads of the DCP group are
  all-gathered (DCP ranks are TP ranks sharing one KV head), each rank attends over its local
  shard, and the partial results are combined exactly by their log-sum-exps (the
  ``merge_attn_states`` kernel): every rank's partial output and LSE are all-gathered in one buffer (DCP,
  then PCP), and each rank merges the parts of its own heads.
- **Prefill without PCP**: each rank has the whole prompt's K/V of its heads: causal attention as
  on one rank; the slot mapping stores only this rank's share.
- **Prefill with PCP**: each rank runs a head-tail share of each prompt
  (:func:`stagewise.model.kv_metadata.split_for_pcp`); per layer the prompt's K/V are all-gathered over
  PCP (dropped after the layer), the local queries attend causally by true position, and the full
  K/V are stored with the interleaved mapping.
- **Chunked prefill** (a chunk after a prompt's first, over a sharded cache): the chunk's K/V are
  stored first, then each of its query rows attends as a decode row does, with its own causal
  limit on each shard (the rank's stored tokens up to the row's position). Under PCP the chunk's
  queries are all-gathered over PCP with its K/V, so every rank attends its shard with the whole
  chunk; the merge is decode's, and each rank keeps its own rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stagewise import ops
from stagewise.kv.cache import LayerKV, as_stored
from stagewise.ops.reference import dequantise_kv, quantise_kv
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata, PcpSplit
from stagewise.model.collectives import Collectives, StageGroups


def valid_dcp_sizes(num_kv_heads: int, tp_size: int) -> list[int]:
    """DCP sizes a layout allows: the divisors of the KV-head replication ``tp / num_kv_heads``
    (1 when TP does not replicate KV heads)."""
    replication = tp_size // num_kv_heads if tp_size % num_kv_heads == 0 else 1
    return [n for n in range(1, replication + 1) if replication % n == 0]


def check_groups(groups: StageGroups, num_kv_heads: int, tp_size: int, local_kv_heads: int) -> None:
    """The layout rules of context parallelism, with errors naming the sizes."""
    if groups.tp.size != tp_size:
        raise ValueError(f"context parallel: the tp group has {groups.tp.size} ranks, the layer was built for "
                         f"tp_size={tp_size}")
    valid = valid_dcp_sizes(num_kv_heads, tp_size)
    if groups.dcp.size not in valid:
        raise ValueError(f"context parallel: dcp={groups.dcp.size} must divide the KV-head replication "
                         f"tp / num_kv_heads = {tp_size} / {num_kv_heads} (DCP ranks share one KV head); "
                         f"valid dcp sizes: {valid}")
    if groups.dcp.size > 1 and local_kv_heads != 1:
        raise ValueError(f"context parallel: a DCP rank must hold exactly one KV head, got {local_kv_heads}")


def check_metadata(groups: StageGroups, meta: KVMetadata) -> None:
    """The step's metadata must come from a manager built for this rank's place in the CP group."""
    if (meta.cp_world_size, meta.cp_rank) != (groups.cp_size, groups.cp_rank):
        raise ValueError(f"context parallel: the KV manager has cp_world_size={meta.cp_world_size}, "
                         f"cp_rank={meta.cp_rank}; the stage's groups need cp_world_size={groups.cp_size} "
                         f"(pcp * dcp), cp_rank={groups.cp_rank}")
    pcp = meta.pcp
    want = None if groups.pcp.size == 1 else (groups.pcp.size, groups.pcp.rank)
    if (None if pcp is None else (pcp.size, pcp.rank)) != want:
        raise ValueError(f"context parallel: KVMetadata.pcp must be split_for_pcp(batch, {groups.pcp.rank}, "
                         f"{groups.pcp.size})" if want else "context parallel: KVMetadata.pcp is set but the "
                         "pcp group has one rank")


def gather_rows(x: torch.Tensor, pad_rows: int, restore: torch.Tensor, group: Collectives) -> torch.Tensor:
    """All-gather every rank's rows ``x [n_rank, ...]`` (padded to ``pad_rows``) and put them in the
    order ``restore`` gives (indices into the rank-major gathered rows)."""
    padded = x.new_zeros((pad_rows, *x.shape[1:]))
    padded[: x.size(0)] = x
    return group.all_gather(padded, dim=0).index_select(0, restore)


def restore_pcp_rows(x: torch.Tensor, split: PcpSplit, group: Collectives) -> torch.Tensor:
    """A stage's output rows of this PCP rank ``x [S_rank, ...]`` -> the full step's ``[T, ...]``, on
    every rank of ``group`` (the PCP group)."""
    if x.size(0) != split.rows.numel():
        raise ValueError(f"restore_pcp_rows: x has {x.size(0)} rows, this rank runs {split.rows.numel()}")
    return gather_rows(x, split.pad_rows, split.restore, group)


def _packed(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """One rank's partial result as one row of bytes ``[1, n]``: ``out``'s, then ``lse``'s (float32),
    so that a single all-gather moves both."""
    return torch.cat([out.reshape(-1).view(torch.uint8), lse.reshape(-1).view(torch.uint8)]).unsqueeze(0)


def merge_partials(rows: torch.Tensor, out_like: torch.Tensor, heads: slice) -> torch.Tensor:
    """The gathered partial results ``rows [K, n]`` (each rank's :func:`_packed` ``out [B, H, D]``
    and ``lse [B, H]``, ``out_like`` giving their shape and dtype) of the heads ``heads`` merged by
    their log-sum-exps -> ``[B, len(heads), D]``: ``merge_attn_states`` of rank 0's with rank 1's,
    the result with rank 2's, and so on (each a strided view of ``rows``, nothing copied first)."""
    b, h, d = out_like.shape
    nbytes = out_like.numel() * out_like.element_size()
    outs = rows[:, :nbytes].view(out_like.dtype).view(rows.size(0), b, h, d)[:, :, heads]
    lses = rows[:, nbytes:].view(torch.float32).view(rows.size(0), b, h)[:, :, heads]
    out, lse = outs[0], lses[0]
    for k in range(1, rows.size(0)):
        out, lse = ops.merge_attn_states(out, lse, outs[k], lses[k])
    return out


def decode_attention_cp(q: torch.Tensor, kv: LayerKV, block_tables: torch.Tensor, local_seq_lens: torch.Tensor,
                        scale: float, groups: StageGroups) -> torch.Tensor:
    """Query rows ``q [B, Hq, D]`` (this rank's heads) over every CP rank's shard -> ``[B, Hq, D]``;
    row ``b`` reads the first ``local_seq_lens[b]`` tokens of ``block_tables[b]`` here (a decode row:
    all its tokens; a prefill chunk's row: those up to its position). The new tokens must already be
    in the cache (their owners wrote them).

    Two collectives besides the kernel: q all-gathered over DCP, then every rank's partial output
    and log-sum-exp all-gathered in one buffer (over DCP, then PCP); each rank merges its own heads.
    One exchange fewer than an all-gather of the LSEs and a reduce-scatter of the weighted outputs,
    for the cost of gathering the outputs of every head (small at decode: ``B * dcp * Hq * D``)."""
    dcp, pcp = groups.dcp, groups.pcp
    q_group = dcp.all_gather(q, dim=1)  # [B, dcp * Hq, D]: the heads of the DCP group's ranks, in rank order
    out, lse = ops.decode_attention(q_group, kv.k, kv.v, block_tables, local_seq_lens, scale, k_scale=kv.k_scale,
                                    v_scale=kv.v_scale)
    if groups.cp_size == 1:
        return out
    rows = pcp.all_gather(dcp.all_gather(_packed(out, lse), dim=0), dim=0)  # [cp, n]: cp-rank order
    hq = q.size(1)
    return merge_partials(rows, out, slice(dcp.rank * hq, (dcp.rank + 1) * hq))


def _pcp_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, split: PcpSplit,
                 scale: float, out: torch.Tensor) -> None:
    """Local queries ``q [P_rank, Hq, D]`` of prompts' first chunks over the whole chunks ``k, v [P, Hk, D]``,
    causal by position (a first chunk's token at position ``x`` is its row ``x``). Later chunks attend
    over the cache (:func:`cp_attention`)."""
    for first, n, start, length, ctx in split.prefill_spans:
        if n == 0 or ctx:
            continue
        qs = q[first : first + n].transpose(0, 1).unsqueeze(0)
        ks, vs = (a[start : start + length].transpose(0, 1).unsqueeze(0) for a in (k, v))
        keys = torch.arange(length, device=q.device)
        mask = keys.unsqueeze(0) <= positions[first : first + n].unsqueeze(1)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                           enable_gqa=qs.size(1) != ks.size(1))
        out[first : first + n] = o[0].transpose(0, 1)


def _gather_prefill(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, split: PcpSplit,
                    group: Collectives) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Every PCP rank's prefill rows of ``k, v`` (and ``q``, when given) in one all-gather, in the
    step's order. A compact cache's rows travel as they will be stored, codes and scales (about a
    quarter of float32's bytes), and come back as stored (:func:`stagewise.kv.cache.as_stored`),
    which is what every query of a compact cache reads."""
    hq = 0 if q is None else q.size(1)
    parts = [] if q is None else [q]
    if kv.k_scale is None:
        whole = gather_rows(torch.cat([*parts, k, v], dim=1), split.prefill_pad, split.prefill_restore, group)
        q_all, k_all, v_all = whole.split([hq, k.size(1), k.size(1)], dim=1)
        return (None if q is None else q_all), k_all, v_all
    stored = [*quantise_kv(k, kv.k.dtype), *quantise_kv(v, kv.v.dtype)]  # codes, scales, codes, scales
    rows = [t.reshape(t.size(0), -1).view(torch.uint8) for t in (*parts, *stored)]
    whole = gather_rows(torch.cat(rows, dim=1), split.prefill_pad, split.prefill_restore, group)
    cut = whole.split([r.size(1) for r in rows], dim=1)
    n = whole.size(0)
    back = [c.contiguous().view(t.dtype).view(n, *t.shape[1:]) for c, t in zip(cut, (*parts, *stored))]
    q_all = None if q is None else back.pop(0)
    k_all, v_all = (dequantise_kv(c, sc).to(k.dtype) for c, sc in (back[:2], back[2:]))
    return q_all, k_all, v_all


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch, meta: KVMetadata,
                 kv: LayerKV, scale: float, groups: StageGroups) -> torch.Tensor:
    """Attention of this rank's rows ``q [T_rank, Hq, D]``, ``k, v [T_rank, Hk, D]`` (rope applied)
    under context parallelism -> ``[T_rank, Hq, D]``; writes this rank's share of the step's K/V.

    A prompt's first chunk attends over itself (all-gathered K/V under PCP); the step's other rows
    (``meta.cp_rows``: decode rows and later chunks) attend over the sharded cache, each with its own
    causal limit (``meta.cp_local_lens``), through :func:`decode_attention_cp`. Under PCP a later
    chunk's queries are all-gathered with its K/V, so every PCP rank attends its shard with all of
    them, and each keeps its own rows of the result."""
    check_metadata(groups, meta)
    p = batch.num_prefill_tokens
    split = meta.pcp
    if split is None:
        ops.reshape_and_cache(k, v, kv.k, kv.v, meta.slot_mapping, kv.k_scale, kv.v_scale)
        if p == 0:  # a decode step: every row reads the cache, in row order (meta.cp_rows is all of them)
            return decode_attention_cp(q.contiguous(), kv, meta.cp_block_tables, meta.cp_local_lens, scale, groups)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if kv.k_scale is not None:  # a first chunk attends over its K/V as the cache holds them
            k, v = as_stored(k, kv.k.dtype), as_stored(v, kv.v.dtype)
        for (start, n), ctx in zip(batch.prefill_spans(), batch.context_lens):
            if ctx:
                continue
            qs, ks, vs = (a[start : start + n].transpose(0, 1).unsqueeze(0) for a in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=qs.size(1) != ks.size(1))
            out[start : start + n] = o[0].transpose(0, 1)
        q_cached = q[meta.cp_rows]
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        q_cached = q[p:]
        if split.prefill_spans:
            # One all-gather of the prefill rows' K and V (and, for chunks after a prompt's first,
            # their queries); the full chunks live only for this layer.
            later = any(span[4] for span in split.prefill_spans)
            q_all, k_all, v_all = _gather_prefill(q[:p] if later else None, k[:p], v[:p], kv, split, groups.pcp)
            _pcp_prefill(q[:p], k_all, v_all, batch.positions[:p], split, scale, out)
            if later:  # the full step's queries, of which the cached rows are taken
                q_cached = torch.cat([q_all, q[p:]])[meta.cp_rows]
            k_all, v_all = torch.cat([k_all, k[p:]]), torch.cat([v_all, v[p:]])
        else:
            k_all, v_all = k, v
        ops.reshape_and_cache(k_all, v_all, kv.k, kv.v, meta.slot_mapping, kv.k_scale, kv.v_scale)
    if meta.cp_rows.numel():
        res = decode_attention_cp(q_cached.contiguous(), kv, meta.cp_block_tables, meta.cp_local_lens, scale, groups)
        if split is None:
            out[meta.cp_rows] = res
        else:
            out[split.cached_local] = res[split.cached_take]
    return out

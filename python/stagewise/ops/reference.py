"""Pure-PyTorch references of the stagewise ops: short, obviously right, slow.

They define the maths the C++ and CUDA kernels are held to, including where
values are rounded to the storage dtype (the same places as HF transformers'
LlamaRMSNorm / Qwen3 attention). They return new tensors instead of writing
in place, so a test can compute the reference before running an in-place op.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """Llama's rounding (the normalised x to x's dtype, then times the weight); with
    ``unit_offset`` Gemma's (times ``1 + weight`` in float32, rounded once)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return (normed.to(x.dtype).float() * weight.float()).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps, unit_offset=False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (new x, new residual) for ``residual += x; x = rms_norm(residual)``."""
    new_residual = (residual.float() + x.float()).to(residual.dtype)
    return rms_norm(new_residual, weight, eps, unit_offset), new_residual


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x: [T, H, rotary_dim] float32; cos, sin: [T, 1, rotary_dim // 2]."""
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat([o1, o2], dim=-1)
    return torch.stack([o1, o2], dim=-1).flatten(-2)


def rope(q, k, positions, cos_sin_cache, is_neox) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns rotated copies of q ``[T, Hq, D]`` and k ``[T, Hk, D]``."""
    rot = cos_sin_cache.size(1)
    cos, sin = cos_sin_cache[positions.long()].float().unsqueeze(1).chunk(2, dim=-1)
    outs = []
    for x in (q, k):
        y = x.clone()
        y[..., :rot] = _rotate(x[..., :rot].float(), cos, sin, is_neox).to(x.dtype)
        outs.append(y)
    return outs[0], outs[1]


def qk_norm_rope(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox, unit_offset=False):
    """Per-head RMSNorm of q and k, then rope; returns new (q, k)."""
    return rope(rms_norm(q, q_weight, eps, unit_offset), rms_norm(k, k_weight, eps, unit_offset), positions,
                cos_sin_cache, is_neox)


# A compact cache's codes: the largest code a row's amax maps onto (include/stagewise/common.h).
KV_CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantise_kv(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [..., D]`` as a compact cache stores them: ``(codes [..., D] code_dtype, scale [...]
    float16)``, each row by itself: ``scale = half(amax / code_max)``, ``code = round(x / scale)``
    (int8: to nearest even, clamped to +-127; e4m3: clamped to +-448, rounded by the cast); a row
    whose scale is 0 (or NaN) stores codes 0."""
    top = KV_CODE_MAX[code_dtype]
    xf = x.float()
    scale = (xf.abs().amax(-1) / top).clamp(max=65504.0).half()
    s = scale.float().unsqueeze(-1)
    y = xf / s
    codes = y.round().clamp(-top, top) if code_dtype == torch.int8 else y.clamp(-top, top)
    codes = torch.where(s > 0, codes, torch.zeros_like(codes)).to(code_dtype)
    return codes, scale


def dequantise_kv(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A compact cache's rows as float32: ``float(code) * float(scale)``."""
    return codes.float() * scale.float().unsqueeze(-1)


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> tuple[torch.Tensor, ...]:
    """Returns updated copies of the caches (and of the scales, after them, for a compact cache)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if k_scale is None:
        k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
        v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]
        return k_cache, v_cache
    k_scale, v_scale = k_scale.clone(), v_scale.clone()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        codes, s = quantise_kv(x[keep], cache.dtype)
        cache.view(-1, *cache.shape[2:])[slots] = codes
        scale.view(-1, scale.size(2))[slots] = s
    return k_cache, v_cache, k_scale, v_scale


def slot_mapping(block_tables, seq_index, positions, block_size, cp_world_size=1, cp_rank=0, interleave_size=1):
    """The context-parallel interleaved slot mapping of ``include/stagewise/cache.h`` (the plain
    paged slot when cp_world_size == 1)."""
    if block_size % interleave_size:
        raise ValueError(f"block_size {block_size} must be a multiple of interleave_size {interleave_size}")
    pos = positions.long()
    virtual_block_size = block_size * cp_world_size
    vblock = pos.clamp(min=0) // virtual_block_size
    offset = pos.clamp(min=0) % virtual_block_size
    local_block = offset // interleave_size
    owner = local_block % cp_world_size
    local_offset = (local_block // cp_world_size) * interleave_size + offset % interleave_size
    block = block_tables.long()[seq_index.long(), vblock]
    slot = block * block_size + local_offset
    return torch.where((owner == cp_rank) & (pos >= 0), slot, torch.full_like(slot, -1))


def gather_kv(k_cache, v_cache, block_table_row, seq_len, start=0, k_scale=None,
              v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached tokens ``[start, seq_len)`` of one sequence, unpaged: ``[seq_len - start, Hk, D]`` each
    (the table's entries before ``start`` are not read); a compact cache's dequantised to float32."""
    block_size = k_cache.size(1)
    t = torch.arange(start, seq_len, device=k_cache.device)
    blocks = block_table_row.long()[t // block_size]
    k, v = k_cache[blocks, t % block_size], v_cache[blocks, t % block_size]
    if k_scale is not None:
        k = dequantise_kv(k, k_scale[blocks, t % block_size])
        v = dequantise_kv(v, v_scale[blocks, t % block_size])
    return k, v


def attention_with_lse(q, k, v, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[Hq, D]`` over k, v ``[N, Hk, D]`` (GQA); returns out ``[Hq, D]`` float32, lse ``[Hq]``."""
    hq, hk = q.size(0), k.size(1)
    if k.size(0) == 0:
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_full((hq,), float("-inf"), dtype=torch.float32)
    kf = k.float().repeat_interleave(hq // hk, dim=1)  # [N, Hq, D]
    vf = v.float().repeat_interleave(hq // hk, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.float(), kf) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), vf)
    return out, lse


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_new=None, v_new=None, window=None,
                     k_scale=None, v_scale=None):
    """Returns (out ``[B, Hq, D]`` in q's dtype, lse ``[B, Hq]`` float32); ``window``: each query's
    last ``window`` keys only (the new token, when given, is the last); ``k_scale, v_scale``: a
    compact cache's scales (its rows read dequantised)."""
    outs, lses = [], []
    for b in range(q.size(0)):
        n = int(seq_lens[b])
        first = 0 if not window else max(0, n + (k_new is not None) - window)
        k, v = gather_kv(k_cache, v_cache, block_tables[b], n, first, k_scale, v_scale)
        if k_new is not None:
            k = torch.cat([k.to(k_new.dtype) if k_scale is None else k, k_new[b : b + 1].to(k.dtype)])
            v = torch.cat([v.to(v_new.dtype) if v_scale is None else v, v_new[b : b + 1].to(v.dtype)])
        out, lse = attention_with_lse(q[b], k, v, scale)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs).to(q.dtype), torch.stack(lses)


def extend_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window=None,
                     k_scale=None, v_scale=None) -> torch.Tensor:
    """``out [T, Hq, D]`` in q's dtype: sequence ``b``'s run, the q rows ``query_start_loc[b] ..
    query_start_loc[b + 1]``, is the last of its ``seq_lens[b]`` cached tokens; each of its tokens
    attends over the cached tokens up to itself (``window``: its last ``window`` of them)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for b in range(block_tables.size(0)):
        start, end, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        k, v = gather_kv(k_cache, v_cache, block_tables[b], n, 0, k_scale, v_scale)
        for i in range(end - start):
            pos = n - (end - start) + i
            first = 0 if not window else max(0, pos - window + 1)
            o, _ = attention_with_lse(q[start + i], k[first : pos + 1], v[first : pos + 1], scale)
            out[start + i] = o.to(q.dtype)
    return out


def merge_attn_states(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE merge of two partial results; a -inf side contributes nothing; a NaN lse on either
    side gives NaN out and lse."""
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)
    total = wa + wb
    lse = torch.where((total > 0) | total.isnan(), m_safe + torch.log(total), torch.full_like(m, float("-inf")))
    denom = torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    out = (out_a.float() * wa.unsqueeze(-1) + out_b.float() * wb.unsqueeze(-1)) / denom
    return out.to(out_a.dtype), lse


def apply_token_bitmask(logits, bitmask, rows) -> torch.Tensor:
    """``logits`` with row ``rows[r]``'s tokens whose bit of ``bitmask[r]`` is clear at -inf."""
    out = logits.clone()
    vocab = logits.size(1)
    for r, row in enumerate(rows.tolist()):
        words = bitmask[r].to(torch.int64) & 0xFFFFFFFF
        bits = (words.unsqueeze(1) >> torch.arange(32, device=words.device)) & 1  # [num_words, 32]
        allowed = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        n = min(vocab, bits.numel())
        allowed[:n] = bits.flatten()[:n].bool()
        out[row] = out[row].masked_fill(~allowed, float("-inf"))
    return out


def dense_linear(x, weight, bias=None) -> torch.Tensor:
    """``x @ weight.T + bias`` (the kernel sums in float32 in its own order)."""
    return torch.nn.functional.linear(x, weight, bias)


# The block-quantised linears (quant_linear, quant_linear_int8) have their own module.
from stagewise.ops.reference_quant import dequantize, quant_linear, quant_linear_int8, quantize_blocks_int8  # noqa: E402,F401

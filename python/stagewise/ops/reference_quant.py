"""Pure-PyTorch references of the block-quantised linears (include/stagewise/quant.h): the GGUF
block layouts dequantised plainly, the exact op as ``F.linear`` over them, and the int8 mode.

Every weight is split into 32-weight sub-blocks (a whole Q4_0 / Q4_1 / Q8_0 block, an eighth of
a Q4_K / Q6_K super-block): integer quants ``q`` (the block's offset already taken off) and, per
half of 16 weights, a float32 scale ``a`` and shift ``b``, so that ``w = q * a + b`` with one
rounding (either ``q * a`` is exact, or ``b`` is 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14  # GGML type ids
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_K: 144, Q6_K: 210}
BLOCK_WEIGHTS = {Q4_0: 32, Q4_1: 32, Q8_0: 32, Q4_K: 256, Q6_K: 256}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 in the last dim's 2 bytes -> float32, that dim dropped."""
    return b.contiguous().view(torch.float16).float()[..., 0]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., 16]`` bytes -> ``[..., 32]``: the low nibbles, then the high ones (Q4_0 / Q4_1)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _q4_k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of Q4_K super-blocks ``[..., 12]`` -> 6-bit scales and mins ``[..., 8]``."""
    s = s.long()
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (mix & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], dim=-1)
    return sc, mn


def sub_blocks(qweight: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF blocks ``[N, blocks * block_bytes]`` uint8 -> ``q [N, S, 32]`` int64 (offset taken off),
    ``a [N, S, 2]`` and ``b [N, S, 2]`` float32, with S sub-blocks of 32 weights a row."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"dequantize: qtype must be one of {sorted(BLOCK_BYTES)} (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), "
                         f"got {qtype!r}")
    n = qweight.shape[0]
    blocks = qweight.reshape(n, -1, BLOCK_BYTES[qtype])
    nb = blocks.shape[1]
    if qtype in (Q4_0, Q4_1, Q8_0):
        d = _f16(blocks[..., 0:2])
        if qtype == Q8_0:
            q = blocks[..., 2:].contiguous().view(torch.int8).long()
        else:
            q = _nibbles(blocks[..., 4:] if qtype == Q4_1 else blocks[..., 2:]).long() - (8 if qtype == Q4_0 else 0)
        b = _f16(blocks[..., 2:4]) if qtype == Q4_1 else torch.zeros_like(d)
        return q, d[..., None].expand(n, nb, 2), b[..., None].expand(n, nb, 2)
    if qtype == Q4_K:
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, mn = _q4_k_scales(blocks[..., 4:16])
        qs = blocks[..., 16:].reshape(n, nb, 4, 1, 32)
        q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, nb * 8, 32).long()  # sub 2c: low, 2c + 1: high
        a = (d[..., None] * sc.float()).reshape(n, nb * 8)
        b = -(dmin[..., None] * mn.float()).reshape(n, nb * 8)
        return q, a[..., None].expand(-1, -1, 2), b[..., None].expand(-1, -1, 2)
    # Q6_K: weight 128 h + r takes ql[64 h + r % 64] >> 4 (r / 64), qh[32 h + r % 32] >> 2 (r / 32)
    ql = blocks[..., 0:128].reshape(n, nb, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(n, nb, 2, 128)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(n, nb, 2, 128)
    q = (low.long() | (high.long() << 4)).reshape(n, nb * 8, 32) - 32
    d = _f16(blocks[..., 208:210])
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [N, nb, 16]
    a = (d[..., None] * sc).reshape(n, nb * 8, 2)
    return q, a, torch.zeros_like(a)


def dequantize(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF blocks ``[rows, blocks * block_bytes]`` uint8 -> ``[rows, in_features]`` float32, the
    values of ``gguf.quants.dequantize``."""
    q, a, b = sub_blocks(qweight, qtype)
    n, s = q.shape[:2]
    halves = q.float().reshape(n, s, 2, 16) * a[..., None] + b[..., None]
    return halves.reshape(n, s * 32)


def quant_linear(x, qweight, qtype, bias=None) -> torch.Tensor:
    """``x @ dequantize(qweight).T + bias`` in float32, rounded to x's dtype."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize(qweight, qtype), b).to(x.dtype)


def quantize_blocks_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x [rows, K]`` (float32) per block of 32 -> ``q [rows, K / 32, 32]`` (integer values
    in float32) and ``d [rows, K / 32, 1]``: ``d = max|x| / 127``, ``q = round_half_even(x * (1 / d))``
    (0 for an all-zero block)."""
    blocks = x.reshape(x.shape[0], x.shape[-1] // 32, 32)  # also for 0 rows
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    return torch.round(blocks * inv), d


def quant_linear_int8(x, qweight, qtype, bias=None) -> torch.Tensor:
    """The int8 mode of quant_linear (include/stagewise/quant.h): x quantised per block
    (quantize_blocks_int8), every sub-block product an exact integer sum scaled by the weight's and
    x's scales in float32, then summed."""
    rows_shape, n = x.shape[:-1], qweight.shape[0]
    q, a, b = sub_blocks(qweight, qtype)  # [N, S, 32], [N, S, 2], [N, S, 2]
    xq, dx = quantize_blocks_int8(x.reshape(-1, x.shape[-1]).float())  # [T, S, 32], [T, S, 1]
    halves = torch.einsum("tsk,nsk->tnsk", xq.double(), q.double()).reshape(*xq.shape[:1], n, q.shape[1], 2, 16)
    isum = halves.sum(-1)  # [T, N, S, 2] exact integers
    dx = dx[..., 0].unsqueeze(1)  # [T, 1, S]
    if qtype == Q6_K:  # d * d_x * (sc_lo * sum_lo + sc_hi * sum_hi): the integer scales recovered from a = d * sc
        d = _f16(qweight.reshape(n, -1, 210)[..., 208:210]).repeat_interleave(8, dim=1)  # [N, S]
        sc = sub_q6_k_scales(qweight)  # [N, S, 2] integers
        y = (d.unsqueeze(0) * dx) * (isum * sc.double().unsqueeze(0)).sum(-1).float()
    else:
        y = (a[..., 0].unsqueeze(0) * dx) * isum.sum(-1).float()
        if qtype in (Q4_1, Q4_K):
            y = y + b[..., 0].unsqueeze(0) * (dx * xq.sum(-1).unsqueeze(1))
    y = y.sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*rows_shape, n).to(x.dtype)


def sub_q6_k_scales(qweight: torch.Tensor) -> torch.Tensor:
    """The int8 scales of Q6_K rows ``[N, blocks * 210]`` per sub-block half: ``[N, S, 2]``."""
    n = qweight.shape[0]
    return qweight.reshape(n, -1, 210)[..., 192:208].contiguous().view(torch.int8).reshape(n, -1, 2)

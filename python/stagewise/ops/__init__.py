"""The decode-path ops of stagewise, as typed Python functions.

Each op is a torch custom op (``torch.ops.stagewise.*``) with a C++ CPU kernel,
a CUDA kernel (when the extension was built against a CUDA torch), a fake
implementation for ``torch.compile`` and a pure-PyTorch reference in
:mod:`stagewise.ops.reference`. Shapes below are the contract other modules
rely on; in-place ops say so.
"""

from __future__ import annotations

import warnings

import torch

from stagewise import _C  # noqa: F401  (loads the library; registers torch.ops.stagewise)
from stagewise.ops import _fake  # noqa: F401  (registers the fake implementations)
from stagewise.ops import reference
from stagewise.ops.qtypes import (  # noqa: F401  (re-exported)
    QTYPES,
    QUANT_BLOCK_BYTES,
    QUANT_BLOCK_WEIGHTS,
    QUANT_PACK_RECORD_BYTES,
    quant_row_bytes,
)

__all__ = [
    "rms_norm",
    "fused_add_rms_norm",
    "rope",
    "qk_norm_rope",
    "reshape_and_cache",
    "slot_mapping",
    "decode_attention",
    "extend_attention",
    "merge_attn_states",
    "apply_token_bitmask",
    "dense_linear",
    "quant_linear",
    "quant_linear_int8",
    "quant_pack_int8",
]
# Also here, not ops: the GGUF block types (QTYPES, the block sizes, quant_row_bytes) and the
# CPU kernels' instruction-set level (cpu_isa, cpu_isa_supported).

def cpu_isa() -> str:
    """The instruction-set level the CPU kernels run: ``baseline``, ``avx2``, ``avx512`` or
    ``avx512vnni`` (the CPU's best, capped by the environment variable ``STAGEWISE_CPU_ISA``,
    read once per process)."""
    return _C.cpu_isa()


def cpu_isa_supported() -> str:
    """The best instruction-set level this CPU has, whatever ``STAGEWISE_CPU_ISA`` says."""
    return _C.cpu_isa_supported()

_ops = torch.ops.stagewise


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [..., hidden]`` with ``weight [hidden]``: the normalised x
    rounded to x's dtype, then times ``weight`` (Llama's); with ``unit_offset`` times ``1 + weight``
    in float32, rounded once (Gemma's, whose checkpoints store the weight less one)."""
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _ops.rms_norm(out, x, weight, eps, unit_offset)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       unit_offset: bool = False) -> None:
    """In place: ``residual += x; x = rms_norm(residual)`` (``unit_offset``: as :func:`rms_norm`)."""
    _ops.fused_add_rms_norm(x, residual, weight, eps, unit_offset)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    rotary_dim: int | None = None,
) -> None:
    """In place rotary embedding of ``q [T, Hq, D]`` and ``k [T, Hk, D]`` at ``positions [T]``.

    ``cos_sin_cache [max_position, rotary_dim]`` holds cos in its first half of
    columns and sin in the second; features from ``rotary_dim`` on are untouched.
    """
    if rotary_dim is not None and cos_sin_cache.dim() == 2 and rotary_dim != cos_sin_cache.size(1):
        raise ValueError(
            f"stagewise.rope: argument 'rotary_dim' must equal cos_sin_cache.size(1)="
            f"{cos_sin_cache.size(1)}, got {rotary_dim}"
        )
    _ops.rope(q, k, positions, cos_sin_cache, is_neox)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    is_neox: bool,
    *,
    unit_offset: bool = False,
) -> None:
    """In place per-head RMSNorm of q and k (weights ``[D]``; ``unit_offset``: Gemma's, as
    :func:`rms_norm`) followed by :func:`rope`."""
    _ops.qk_norm_rope(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox, unit_offset)


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``k, v [T, Hk, D]`` into the paged caches ``[num_blocks, block_size, Hk, D]``.

    ``slot_mapping[t] = block * block_size + offset``; -1 skips the token (padding). A compact
    cache (int8 or float8_e4m3fn codes) takes each token's head row quantised by itself and its
    float16 scale into ``k_scale, v_scale [num_blocks, block_size, Hk]``
    (:func:`stagewise.ops.reference.quantise_kv` is the formula).
    """
    _ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def slot_mapping(
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    interleave_size: int = 1,
) -> torch.Tensor:
    """Cache slot of each token: ``[T]`` int64, -1 where the token is padding or another CP rank's.

    ``block_tables [num_seqs, max_blocks]``, ``seq_index [T]`` (row of each token),
    ``positions [T]``. With ``cp_world_size > 1`` the context-parallel interleaved layout: a
    block-table entry is a virtual block of ``block_size * cp_world_size`` positions, dealt to the
    ranks in runs of ``interleave_size``; each rank stores its share in one local block
    (``include/stagewise/cache.h`` has the formula).
    """
    return _ops.slot_mapping(block_tables, seq_index, positions, block_size, cp_world_size, cp_rank, interleave_size)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    num_splits: int | None = None,
    *,
    window: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-decoding of ``q [B, Hq, D]`` over the paged cache (and the new token).

    Attends over the first ``seq_lens[b]`` cached tokens of each sequence and,
    when given, the token ``k_new/v_new [B, Hk, D]`` not yet in the cache; the
    parts are merged by log-sum-exp. With ``window`` (a sliding window) each
    query attends to its last ``window`` keys only, the query being the newest
    token (``k_new`` when given, else the last cached one): cached tokens
    ``[seq_len + has_new - window, seq_len)``; those before, and their
    block-table entries, are never read. Returns ``out [B, Hq, D]`` (q's dtype)
    and ``lse [B, Hq]`` float32; a sequence with nothing to attend to gets
    ``lse = -inf`` and ``out = 0``. ``num_splits=None`` picks a split count. A compact cache
    (int8 or float8_e4m3fn codes with their float16 ``k_scale, v_scale [num_blocks, block_size,
    Hk]``) is read as codes and scaled in registers; ``k_new, v_new`` stay in q's dtype.
    """
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"stagewise.decode_attention: argument 'num_splits' must be >= 1 or None, got {num_splits}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"stagewise.decode_attention: argument 'window' must be an int >= 1 or None, got {window!r}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if _off_the_cuda_kernels(q):
        ref_out, ref_lse = reference.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_new, v_new,
                                                      window, k_scale, v_scale)
        return out.copy_(ref_out), lse.copy_(ref_lse)
    _ops.decode_attention(out, lse, q, k_cache, v_cache, block_tables, seq_lens, scale, k_new, v_new, num_splits or 0,
                          window or 0, k_scale, v_scale)
    return out, lse


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of runs of new tokens ``q [T, Hq, D]`` whose K/V the paged cache already holds:
    sequence ``b``'s run is the rows ``query_start_loc[b] .. query_start_loc[b + 1]`` (``[B + 1]``,
    from 0 to T), the last tokens of its ``seq_lens[b]`` cached ones; each attends causally over the
    cache up to itself (``window``: its last ``window`` keys, itself included). A prompt's chunk
    after its cached tokens, drafts being verified, a whole prompt. Returns ``out [T, Hq, D]`` (q's
    dtype). A compact cache as :func:`decode_attention`'s. On the CPU the tokens of a run share
    every K/V row they read; on CUDA each runs as a decode row."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"stagewise.extend_attention: argument 'window' must be an int >= 1 or None, got {window!r}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if _off_the_cuda_kernels(q):
        return out.copy_(reference.extend_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                                    scale, window, k_scale, v_scale))
    _ops.extend_attention(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window or 0,
                          k_scale, v_scale)
    return out


CUDA_HEAD_DIMS = (64, 128, 256)
"""The head sizes the CUDA attention kernels are compiled for (every common model's: SmolLM2 and
Falcon 64, Llama and Qwen 128, Gemma 256). On a GPU, :func:`decode_attention` and
:func:`extend_attention` run any other through the pure-torch reference (:mod:`stagewise.ops.reference`):
correct, a loop over the batch in Python, and not capturable in a CUDA graph."""


_warned_head_dims: set[int] = set()


def _off_the_cuda_kernels(q: torch.Tensor) -> bool:
    """Whether ``q``'s attention runs the reference (said once per head size: never a quiet fallback)."""
    off = q.is_cuda and q.dim() == 3 and q.size(-1) not in CUDA_HEAD_DIMS
    if off and q.size(-1) not in _warned_head_dims:
        _warned_head_dims.add(q.size(-1))
        warnings.warn(f"stagewise: no CUDA attention kernel for head_dim {q.size(-1)} (they take "
                      f"{', '.join(map(str, CUDA_HEAD_DIMS))}): attention runs the pure-torch reference, slowly",
                      RuntimeWarning, stacklevel=3)
    return off


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: row ``rows[r]`` of ``logits [batch, vocab]`` keeps the tokens whose bit is set in
    ``bitmask[r]`` (int32 ``[num_rows, num_words]``, 32 tokens to a word, bit ``j % 32`` of word
    ``j // 32``: llguidance's and xgrammar's layout); the others, and tokens past the mask's
    words, become -inf. ``rows``: int32/int64 ``[num_rows]``; other rows are not touched."""
    _ops.apply_token_bitmask(logits, bitmask, rows)


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results ``[N, H, D]`` by their LSEs ``[N, H]`` (float32).

    A side with ``lse = -inf`` contributes nothing: the other side is returned exactly.
    """
    if out is None:
        out = torch.empty(out_a.shape, dtype=out_a.dtype, device=out_a.device)
    if lse is None:
        lse = torch.empty(lse_a.shape, dtype=torch.float32, device=lse_a.device)
    _ops.merge_attn_states(out, lse, out_a, lse_a, out_b, lse_b)
    return out, lse


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., in] @ weight.T + bias`` -> ``[..., out_features]`` in x's dtype: ``F.linear`` on the CPU.

    ``weight [out_features, in]`` contiguous and ``bias [out_features]`` in x's dtype (float32,
    float16 or bfloat16). In float32, the few rows of a decode step (up to
    ``dense_linear_max_rows()``) take a GEMV kernel that reads the weights at the memory's pace,
    summing in float32 in its own order; more rows, and the half dtypes, a BLAS GEMM as
    ``F.linear`` does. CPU only.
    """
    if x.device.type != "cpu":
        raise NotImplementedError(f"stagewise.dense_linear: runs on the CPU only, got x on {x.device}; use "
                                  f"F.linear there")
    out = _linear_out(x, weight, out)
    _ops.dense_linear(out, x, weight, bias)
    return out


def dense_linear_max_rows() -> int:
    """The most rows of x (its leading dims flattened) that :func:`dense_linear` runs through its
    float32 kernel at this ISA level; more go to a BLAS GEMM."""
    return _C.dense_linear_max_rows()


def _linear_out(x: torch.Tensor, qweight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out``, or a new ``[..., out_features]`` tensor in x's dtype (the ops check either)."""
    if out is not None:
        return out
    n = qweight.shape[0] if qweight.dim() >= 1 else 0
    return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qtype: int,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., in] @ dequant(qweight).T + bias`` -> ``[..., out_features]`` in x's dtype.

    ``qweight [out_features, in / block_weights * block_bytes]`` uint8 holds the GGUF blocks of
    ``W [out_features, in]`` row by row, ``qtype`` their GGML type id (:data:`QTYPES`: Q4_0,
    Q4_1, Q8_0 in blocks of 32 weights, Q4_K and Q6_K in blocks of 256).
    The weights are their exact float32 dequantised values and the sums are float32,
    rounded once to x's dtype with the bias added (bias ``[out_features]`` in x's dtype).
    On the CPU with AVX2 or AVX-512, a few rows (decode) take a kernel that reads each block once;
    from 10 (AVX2) or 28 (AVX-512) rows on, and on other CPUs always, a tile kernel that
    dequantises a few weight rows at a time and runs every row against them; both give these values
    up to summation order (the tile kernel's bits per row do not depend on the other rows or the
    threads).
    """
    out = _linear_out(x, qweight, out)
    _ops.quant_linear(out, x, qweight, qtype, bias)
    return out


def quant_pack_int8(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """The GGUF rows ``qweight [out_features, in / block_weights * block_bytes]`` regrouped for
    :func:`quant_linear_int8`: panels of 16 rows, one row per 32-bit vector lane
    (``[ceil(out_features / 16), in / block_weights * record_bytes]`` uint8, layout in
    csrc/cpu/quant_pack.h). Done once per weight, when a model is loaded; CPU only."""
    if qweight.device.type != "cpu":
        raise NotImplementedError(f"stagewise.quant_pack_int8: the int8 mode runs on the CPU only, got qweight on "
                                  f"{qweight.device}")
    return _ops.quant_pack_int8(qweight, qtype)


def quant_linear_int8(
    x: torch.Tensor,
    packed: torch.Tensor,
    qtype: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`quant_linear` in reduced precision (approximate; CPU only), over the weights as
    :func:`quant_pack_int8` packed them: each block of 32 values of a row of x is quantised to int8
    with a float32 scale (``max|x| / 127``, ties to even) and multiplied with the weight blocks in
    integer arithmetic, block results summed in float32 (the maths of include/stagewise/quant.h,
    written plainly in :func:`stagewise.ops.reference.quant_linear_int8`, which takes the GGUF rows).
    The error against :func:`quant_linear` is that of quantising x: at most ``max|x| / 254`` per
    value, per block. ``x [..., in]`` -> ``[..., out_features]`` in x's dtype.
    """
    if x.device.type != "cpu":
        raise NotImplementedError(f"stagewise.quant_linear_int8: the int8 mode runs on the CPU only, got x on "
                                  f"{x.device}; use quant_linear (exact) there")
    if out is None:
        out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype, device=x.device)
    _ops.quant_linear_int8(out, x, packed, qtype, bias)
    return out

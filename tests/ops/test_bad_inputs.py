"""Bad inputs: every op rejects each kind of wrong argument with an error that names
the op, the argument, what was expected and what was given (TypeError for dtypes,
ValueError for ranks, shapes, strides and devices), never a crash, and a rejected
call leaves every tensor it was given, in-place ones included, unchanged.

Each case starts from small valid arguments (VALID) and breaks one thing. Expected
messages are the ones of csrc/bindings/params.cpp (and, for devices, of the fake
implementations in stagewise/ops/_fake.py, which a call with a "meta" tensor reaches).
Out-of-range index values (slots, block ids, positions) are tested with the kernels.
"""

from __future__ import annotations

import re

import pytest
import torch

import stagewise.ops as ops
from helpers.kernels import HAS_CUDA, strided

T, HIDDEN = 3, 8  # tokens, hidden size (norms)
B, HQ, HK, D = 2, 4, 2, 8  # batch, query heads, kv heads, head dim
NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 4, 4, 2  # paged cache
MAX_POSITION = 16  # rows of cos_sin_cache

# ---------------------------------------------------------------------------
# Valid arguments of each op, by schema name (csrc/bindings/schema.cpp).


def _f(*shape, device):
    return torch.randn(shape, device=device)


def _i(*values, device, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=device)


def _rms_norm(dev):
    return dict(out=_f(T, HIDDEN, device=dev), x=_f(T, HIDDEN, device=dev), weight=_f(HIDDEN, device=dev), eps=1e-6)


def _fused_add_rms_norm(dev):
    x, residual = _f(T, HIDDEN, device=dev), _f(T, HIDDEN, device=dev)
    return dict(x=x, residual=residual, weight=_f(HIDDEN, device=dev), eps=1e-6)


def _rope(dev):
    return dict(
        q=_f(T, HQ, D, device=dev),
        k=_f(T, HK, D, device=dev),
        positions=_i(0, 5, 15, device=dev),
        cos_sin_cache=_f(MAX_POSITION, D, device=dev),
        is_neox=True,
    )


def _qk_norm_rope(dev):
    a = _rope(dev)
    is_neox = a.pop("is_neox")
    return dict(a, q_weight=_f(D, device=dev), k_weight=_f(D, device=dev), eps=1e-6, is_neox=is_neox)


def _reshape_and_cache(dev):
    return dict(
        k=_f(T, HK, D, device=dev),
        v=_f(T, HK, D, device=dev),
        k_cache=_f(NUM_BLOCKS, BLOCK_SIZE, HK, D, device=dev),
        v_cache=_f(NUM_BLOCKS, BLOCK_SIZE, HK, D, device=dev),
        slot_mapping=_i(6, -1, 13, device=dev),
    )


def _slot_mapping(dev):
    return dict(
        block_tables=_i(2, 0, 1, 3, device=dev, dtype=torch.int32).view(2, MAX_BLOCKS),
        seq_index=_i(0, 1, 1, device=dev, dtype=torch.int32),
        positions=_i(5, 0, 7, device=dev),
        block_size=BLOCK_SIZE,
        cp_world_size=1,
        cp_rank=0,
        interleave_size=1,
    )


def _decode_attention(dev):
    return dict(
        out=_f(B, HQ, D, device=dev),
        lse=_f(B, HQ, device=dev),
        q=_f(B, HQ, D, device=dev),
        k_cache=_f(NUM_BLOCKS, BLOCK_SIZE, HK, D, device=dev),
        v_cache=_f(NUM_BLOCKS, BLOCK_SIZE, HK, D, device=dev),
        block_tables=_i(2, 0, 1, 3, device=dev, dtype=torch.int32).view(B, MAX_BLOCKS),
        seq_lens=_i(5, 3, device=dev, dtype=torch.int32),
        scale=D**-0.5,
        k_new=_f(B, HK, D, device=dev),
        v_new=_f(B, HK, D, device=dev),
        num_splits=0,
        window=0,
    )


def _extend_attention(dev):
    return dict(
        out=_f(T, HQ, D, device=dev),
        q=_f(T, HQ, D, device=dev),
        k_cache=_f(NUM_BLOCKS, BLOCK_SIZE, HK, D, device=dev),
        v_cache=_f(NUM_BLOCKS, BLOCK_SIZE, HK, D, device=dev),
        block_tables=_i(2, 0, 1, 3, device=dev, dtype=torch.int32).view(B, MAX_BLOCKS),
        query_start_loc=_i(0, 2, 3, device=dev, dtype=torch.int32),
        seq_lens=_i(5, 3, device=dev, dtype=torch.int32),
        scale=D**-0.5,
        window=0,
    )


def _merge_attn_states(dev):
    return dict(
        out=_f(T, HQ, D, device=dev),
        lse=_f(T, HQ, device=dev),
        out_a=_f(T, HQ, D, device=dev),
        lse_a=_f(T, HQ, device=dev),
        out_b=_f(T, HQ, D, device=dev),
        lse_b=_f(T, HQ, device=dev),
    )


def _apply_token_bitmask(dev):
    return dict(logits=_f(T, 70, device=dev), bitmask=torch.zeros(2, 3, dtype=torch.int32, device=dev),
                rows=_i(0, 2, device=dev))


def _dense_linear(dev):
    return dict(out=_f(T, 6, device=dev), x=_f(T, 20, device=dev), weight=_f(6, 20, device=dev), bias=_f(6, device=dev))


def _quant_linear(dev):
    # Q4_1 blocks of zeros (d = m = 0) are valid blocks; 64 inputs = 2 blocks of 20 bytes a row.
    return dict(out=_f(T, 6, device=dev), x=_f(T, 64, device=dev),
                qweight=torch.zeros(6, 40, dtype=torch.uint8, device=dev), qtype=3, bias=_f(6, device=dev))


def _quant_linear_int8(dev):
    # The same weights packed (zeros pack into zeros): one panel of 2 records of 320 bytes.
    return dict(_quant_linear(dev), qweight=torch.zeros(1, 640, dtype=torch.uint8, device=dev))


def _quant_pack_int8(dev):
    return dict(qweight=torch.zeros(6, 40, dtype=torch.uint8, device=dev), qtype=3)


VALID = {
    "rms_norm": _rms_norm,
    "fused_add_rms_norm": _fused_add_rms_norm,
    "rope": _rope,
    "qk_norm_rope": _qk_norm_rope,
    "reshape_and_cache": _reshape_and_cache,
    "slot_mapping": _slot_mapping,
    "decode_attention": _decode_attention,
    "extend_attention": _extend_attention,
    "merge_attn_states": _merge_attn_states,
    "apply_token_bitmask": _apply_token_bitmask,
    "dense_linear": _dense_linear,
    "quant_linear": _quant_linear,
    "quant_linear_int8": _quant_linear_int8,
    "quant_pack_int8": _quant_pack_int8,
}

# The argument whose device every other tensor argument must share.
DEVICE_REF = {
    "rms_norm": "x",
    "fused_add_rms_norm": "x",
    "rope": "q",
    "qk_norm_rope": "q",
    "reshape_and_cache": "k",
    "slot_mapping": "block_tables",
    "decode_attention": "q",
    "extend_attention": "q",
    "merge_attn_states": "out_a",
    "apply_token_bitmask": "logits",
    "dense_linear": "x",
    "quant_linear": "x",
    "quant_linear_int8": "x",
    "quant_pack_int8": "qweight",
}

# ---------------------------------------------------------------------------
# Breaking one argument. An edit is (kind, argument name[, value]):
#   ("dtype", name, dtype)   convert
#   ("shape", name, shape)   replace by a tensor of that shape (same dtype/device)
#   ("last_dim", name)       same values, last dim with stride 2
#   ("rows", name)           same values, padded rows (dim 0), so not contiguous
#   ("set", name, value)     any other value (None, a scalar)


def _apply(args: dict, kind: str, name: str, value=None) -> None:
    t = args[name]
    if kind == "dtype":
        args[name] = t.to(value)
    elif kind == "shape":
        new = torch.randn(value, device=t.device) if t.is_floating_point() else torch.zeros(value, device=t.device)
        args[name] = new.to(t.dtype)
    elif kind == "last_dim":
        buf = t.new_zeros(*t.shape, 2)
        buf[..., 0] = t
        args[name] = buf[..., 0]
    elif kind == "rows":
        args[name] = strided(t)
    elif kind == "set":
        args[name] = value
    else:
        raise ValueError(f"unknown edit kind {kind!r}")


def _case(op: str, exc: type, fragment: str, *edits: tuple):
    name = "+".join(f"{e[0]}-{e[1]}" for e in edits)
    return pytest.param(op, edits, exc, fragment, id=f"{op}-{name}")


# Shared by rope and qk_norm_rope (one check in params.cpp, two ops).
_ROPE = [
    (TypeError, "argument 'q' must be float32, float16 or bfloat16, got int32", ("dtype", "q", torch.int32)),
    (TypeError, "argument 'k' must have the dtype of 'q' (float32), got float16", ("dtype", "k", torch.float16)),
    (TypeError, "argument 'positions' must be int32 or int64, got float32", ("dtype", "positions", torch.float32)),
    (TypeError, "argument 'positions' must be int32 or int64, got int16", ("dtype", "positions", torch.int16)),
    (TypeError, "argument 'cos_sin_cache' must be float32, float16 or bfloat16, got int32",
     ("dtype", "cos_sin_cache", torch.int32)),
    (TypeError, "argument 'cos_sin_cache' must be float32 or the dtype of 'q' (bfloat16), got float16",
     ("dtype", "q", torch.bfloat16), ("dtype", "k", torch.bfloat16), ("dtype", "cos_sin_cache", torch.float16)),
    (ValueError, "argument 'q' must have 3 dims [num_tokens, num_q_heads, head_dim], got 2 dims with shape [3, 32]",
     ("shape", "q", (T, HQ * D))),
    (ValueError,
     "argument 'k' must have 3 dims [num_tokens, num_k_heads, head_dim], got 4 dims with shape [3, 2, 8, 1]",
     ("shape", "k", (T, HK, D, 1))),
    (ValueError, "argument 'positions' must have 1 dims [num_tokens], got 2 dims with shape [3, 1]",
     ("shape", "positions", (T, 1))),
    (ValueError, "argument 'cos_sin_cache' must have 2 dims [max_position, rotary_dim], got 1 dims with shape [128]",
     ("shape", "cos_sin_cache", (MAX_POSITION * D,))),
    (ValueError, "argument 'k' dim 0 (num_tokens, as in q) must be 3, got 2 (shape [2, 2, 8])",
     ("shape", "k", (2, HK, D))),
    (ValueError, "argument 'k' dim 2 (head_dim, as in q) must be 8, got 6", ("shape", "k", (T, HK, 6))),
    (ValueError, "argument 'positions' dim 0 (num_tokens, as in q) must be 3, got 4", ("shape", "positions", (4,))),
    (ValueError, "argument 'cos_sin_cache' dim 1 (rotary_dim) must be even and in [2, head_dim=8], got 10",
     ("shape", "cos_sin_cache", (MAX_POSITION, 10))),
    (ValueError, "argument 'cos_sin_cache' dim 1 (rotary_dim) must be even and in [2, head_dim=8], got 5",
     ("shape", "cos_sin_cache", (MAX_POSITION, 5))),
    (ValueError, "argument 'q' must have a contiguous last dim (stride 1), got strides [64, 16, 2]", ("last_dim", "q")),
    (ValueError, "argument 'k' must have a contiguous last dim (stride 1), got strides [32, 16, 2]", ("last_dim", "k")),
    (ValueError, "argument 'positions' must be contiguous, got shape [3] with strides [4]", ("rows", "positions")),
    (ValueError, "argument 'cos_sin_cache' must be contiguous, got shape [16, 8] with strides [11, 1]",
     ("rows", "cos_sin_cache")),
]

CASES = [
    # rms_norm(out, x, weight, eps)
    _case("rms_norm", TypeError, "argument 'x' must be float32, float16 or bfloat16, got int32",
          ("dtype", "x", torch.int32)),
    _case("rms_norm", TypeError, "argument 'weight' must have the dtype of 'x' (float32), got float16",
          ("dtype", "weight", torch.float16)),
    _case("rms_norm", TypeError, "argument 'out' must have the dtype of 'x' (float32), got bfloat16",
          ("dtype", "out", torch.bfloat16)),
    _case("rms_norm", ValueError, "argument 'x' must have at least 1 dim [..., hidden], got a scalar",
          ("shape", "x", ())),
    _case("rms_norm", ValueError, "argument 'weight' must have 1 dims [hidden], got 2 dims with shape [8, 1]",
          ("shape", "weight", (HIDDEN, 1))),
    _case("rms_norm", ValueError, "argument 'weight' dim 0 (hidden) must be 8, got 7 (shape [7])",
          ("shape", "weight", (7,))),
    _case("rms_norm", ValueError, "argument 'out' must have the shape of 'x' [3, 8], got [3, 7]",
          ("shape", "out", (T, 7))),
    _case("rms_norm", ValueError, "argument 'x' must have a non-empty last dim (hidden >= 1), got shape [3, 0]",
          ("shape", "x", (T, 0)), ("shape", "out", (T, 0)), ("shape", "weight", (0,))),
    _case("rms_norm", ValueError, "argument 'x' must have a contiguous last dim (stride 1), got strides [16, 2]",
          ("last_dim", "x")),
    _case("rms_norm", ValueError, "argument 'out' must have a contiguous last dim (stride 1), got strides [16, 2]",
          ("last_dim", "out")),
    _case("rms_norm", ValueError, "argument 'weight' must be contiguous, got shape [8] with strides [4]",
          ("rows", "weight")),
    # [3, 2, 8] whose dims 0 and 1 are swapped in memory: no single row stride
    _case("rms_norm", ValueError,
          "argument 'x' must have leading dims that collapse into one strided row dim, "
          "got shape [3, 2, 8] with strides [8, 24, 1]",
          ("set", "x", torch.randn(2, T, HIDDEN).transpose(0, 1)), ("shape", "out", (T, 2, HIDDEN))),
    # fused_add_rms_norm(x, residual, weight, eps)
    _case("fused_add_rms_norm", TypeError, "argument 'x' must be float32, float16 or bfloat16, got int64",
          ("dtype", "x", torch.int64)),
    _case("fused_add_rms_norm", TypeError, "argument 'residual' must have the dtype of 'x' (float32), got float16",
          ("dtype", "residual", torch.float16)),
    _case("fused_add_rms_norm", TypeError, "argument 'weight' must have the dtype of 'x' (float32), got bfloat16",
          ("dtype", "weight", torch.bfloat16)),
    _case("fused_add_rms_norm", ValueError, "argument 'x' must have at least 1 dim [..., hidden], got a scalar",
          ("shape", "x", ())),
    _case("fused_add_rms_norm", ValueError, "argument 'weight' must have 1 dims [hidden], got 0 dims with shape []",
          ("shape", "weight", ())),
    _case("fused_add_rms_norm", ValueError, "argument 'residual' must have the shape of 'x' [3, 8], got [2, 8]",
          ("shape", "residual", (2, HIDDEN))),
    _case("fused_add_rms_norm", ValueError, "argument 'weight' dim 0 (hidden) must be 8, got 9",
          ("shape", "weight", (9,))),
    _case("fused_add_rms_norm", ValueError,
          "argument 'x' must have a contiguous last dim (stride 1), got strides [16, 2]",
          ("last_dim", "x")),
    _case("fused_add_rms_norm", ValueError,
          "argument 'residual' must have a contiguous last dim (stride 1), got strides [16, 2]",
          ("last_dim", "residual")),
    _case("fused_add_rms_norm", ValueError, "argument 'weight' must be contiguous, got shape [8] with strides [4]",
          ("rows", "weight")),
    # rope(q, k, positions, cos_sin_cache, is_neox) and the same checks of qk_norm_rope
    *(_case(op, exc, fragment, *edits) for op in ("rope", "qk_norm_rope") for exc, fragment, *edits in _ROPE),
    # qk_norm_rope: its weights
    _case("qk_norm_rope", TypeError, "argument 'q_weight' must have the dtype of 'q' (float32), got float16",
          ("dtype", "q_weight", torch.float16)),
    _case("qk_norm_rope", ValueError, "argument 'k_weight' must have 1 dims [head_dim], got 2 dims with shape [1, 8]",
          ("shape", "k_weight", (1, D))),
    _case("qk_norm_rope", ValueError, "argument 'k_weight' dim 0 (head_dim) must be 8, got 7",
          ("shape", "k_weight", (7,))),
    _case("qk_norm_rope", ValueError, "argument 'q_weight' must be contiguous, got shape [8] with strides [4]",
          ("rows", "q_weight")),
    # reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    _case("reshape_and_cache", TypeError, "argument 'k' must be float32, float16 or bfloat16, got int32",
          ("dtype", "k", torch.int32)),
    _case("reshape_and_cache", TypeError, "argument 'v' must have the dtype of 'k' (float32), got float16",
          ("dtype", "v", torch.float16)),
    _case("reshape_and_cache", TypeError, "argument 'k_cache' must have the dtype of 'k' (float32), got bfloat16",
          ("dtype", "k_cache", torch.bfloat16)),
    _case("reshape_and_cache", TypeError, "argument 'v_cache' must have the dtype of 'k' (float32), got float16",
          ("dtype", "v_cache", torch.float16)),
    _case("reshape_and_cache", TypeError, "argument 'slot_mapping' must be int32 or int64, got float32",
          ("dtype", "slot_mapping", torch.float32)),
    _case("reshape_and_cache", ValueError,
          "argument 'k' must have 3 dims [num_tokens, num_heads, head_dim], got 2 dims with shape [3, 16]",
          ("shape", "k", (T, HK * D))),
    _case("reshape_and_cache", ValueError,
          "argument 'k_cache' must have 4 dims [num_blocks, block_size, num_heads, head_dim], "
          "got 3 dims with shape [16, 2, 8]",
          ("shape", "k_cache", (NUM_BLOCKS * BLOCK_SIZE, HK, D))),
    _case("reshape_and_cache", ValueError,
          "argument 'slot_mapping' must have 1 dims [num_tokens], got 2 dims with shape [3, 1]",
          ("shape", "slot_mapping", (T, 1))),
    _case("reshape_and_cache", ValueError, "argument 'v' must have the shape of 'k' [3, 2, 8], got [3, 3, 8]",
          ("shape", "v", (T, 3, D))),
    _case("reshape_and_cache", ValueError, "argument 'k_cache' dim 2 (num_heads, as in k) must be 2, got 3",
          ("shape", "k_cache", (NUM_BLOCKS, BLOCK_SIZE, 3, D))),
    _case("reshape_and_cache", ValueError, "argument 'v_cache' dim 2 (num_heads, as in k) must be 2, got 1",
          ("shape", "v_cache", (NUM_BLOCKS, BLOCK_SIZE, 1, D))),
    _case("reshape_and_cache", ValueError, "argument 'k_cache' dim 3 (head_dim, as in k) must be 8, got 4",
          ("shape", "k_cache", (NUM_BLOCKS, BLOCK_SIZE, HK, 4))),
    _case("reshape_and_cache", ValueError,
          "argument 'v_cache' must have the shape of 'k_cache' [4, 4, 2, 8], got [5, 4, 2, 8]",
          ("shape", "v_cache", (5, BLOCK_SIZE, HK, D))),
    _case("reshape_and_cache", ValueError, "argument 'slot_mapping' dim 0 (num_tokens, as in k) must be 3, got 2",
          ("shape", "slot_mapping", (2,))),
    _case("reshape_and_cache", ValueError,
          "argument 'k' must have a contiguous last dim (stride 1), got strides [32, 16, 2]",
          ("last_dim", "k")),
    _case("reshape_and_cache", ValueError,
          "argument 'v' must have a contiguous last dim (stride 1), got strides [32, 16, 2]",
          ("last_dim", "v")),
    _case("reshape_and_cache", ValueError,
          "argument 'k_cache' must be contiguous, got shape [4, 4, 2, 8] with strides [67, 16, 8, 1]",
          ("rows", "k_cache")),
    _case("reshape_and_cache", ValueError,
          "argument 'v_cache' must be contiguous, got shape [4, 4, 2, 8] with strides [67, 16, 8, 1]",
          ("rows", "v_cache")),
    _case("reshape_and_cache", ValueError, "argument 'slot_mapping' must be contiguous, got shape [3] with strides [4]",
          ("rows", "slot_mapping")),
    # slot_mapping(block_tables, seq_index, positions, block_size, cp_world_size, cp_rank, interleave_size)
    _case("slot_mapping", TypeError, "argument 'block_tables' must be int32 or int64, got float32",
          ("dtype", "block_tables", torch.float32)),
    _case("slot_mapping", TypeError, "argument 'seq_index' must be int32 or int64, got float32",
          ("dtype", "seq_index", torch.float32)),
    _case("slot_mapping", TypeError, "argument 'positions' must be int32 or int64, got float16",
          ("dtype", "positions", torch.float16)),
    _case("slot_mapping", ValueError,
          "argument 'block_tables' must have 2 dims [num_seqs, max_blocks], got 1 dims with shape [4]",
          ("shape", "block_tables", (4,))),
    _case("slot_mapping", ValueError,
          "argument 'positions' must have 1 dims [num_tokens], got 2 dims with shape [3, 1]",
          ("shape", "positions", (T, 1))),
    _case("slot_mapping", ValueError,
          "argument 'seq_index' must have 1 dims [num_tokens], got 2 dims with shape [3, 1]",
          ("shape", "seq_index", (T, 1))),
    _case("slot_mapping", ValueError, "argument 'seq_index' dim 0 (num_tokens, as in positions) must be 3, got 4",
          ("shape", "seq_index", (4,))),
    _case("slot_mapping", ValueError,
          "argument 'block_tables' must have a contiguous last dim (stride 1), got strides [4, 2]",
          ("last_dim", "block_tables")),
    _case("slot_mapping", ValueError, "argument 'positions' must be contiguous, got shape [3] with strides [4]",
          ("rows", "positions")),
    _case("slot_mapping", ValueError, "argument 'seq_index' must be contiguous, got shape [3] with strides [4]",
          ("rows", "seq_index")),
    _case("slot_mapping", ValueError, "argument 'block_size' must be >= 1, got 0", ("set", "block_size", 0)),
    _case("slot_mapping", ValueError, "argument 'cp_world_size' must be >= 1, got 0", ("set", "cp_world_size", 0)),
    _case("slot_mapping", ValueError, "argument 'cp_rank' must be in [0, cp_world_size=2), got 2",
          ("set", "cp_world_size", 2), ("set", "cp_rank", 2)),
    _case("slot_mapping", ValueError, "argument 'cp_rank' must be in [0, cp_world_size=1), got -1",
          ("set", "cp_rank", -1)),
    _case("slot_mapping", ValueError, "argument 'interleave_size' must divide block_size=4, got 3",
          ("set", "interleave_size", 3)),
    _case("slot_mapping", ValueError, "argument 'interleave_size' must divide block_size=4, got 0",
          ("set", "interleave_size", 0)),
    # decode_attention(out, lse, q, k_cache, v_cache, block_tables, seq_lens, scale, k_new, v_new, num_splits,
    #                  window)
    _case("decode_attention", TypeError, "argument 'q' must be float32, float16 or bfloat16, got int32",
          ("dtype", "q", torch.int32)),
    _case("decode_attention", TypeError, "argument 'k_cache' must have the dtype of 'q' (float32), got float16",
          ("dtype", "k_cache", torch.float16)),
    _case("decode_attention", TypeError, "argument 'v_cache' must have the dtype of 'q' (float32), got bfloat16",
          ("dtype", "v_cache", torch.bfloat16)),
    _case("decode_attention", TypeError, "argument 'block_tables' must be int32 or int64, got float32",
          ("dtype", "block_tables", torch.float32)),
    _case("decode_attention", TypeError, "argument 'seq_lens' must be int32 or int64, got float32",
          ("dtype", "seq_lens", torch.float32)),
    _case("decode_attention", TypeError, "argument 'k_new' must have the dtype of 'q' (float32), got float16",
          ("dtype", "k_new", torch.float16)),
    _case("decode_attention", TypeError, "argument 'v_new' must have the dtype of 'q' (float32), got bfloat16",
          ("dtype", "v_new", torch.bfloat16)),
    _case("decode_attention", TypeError, "argument 'out' must have the dtype of 'q' (float32), got float16",
          ("dtype", "out", torch.float16)),
    # the likely slip: lse allocated like q
    _case("decode_attention", TypeError, "argument 'lse' must be float32 (log-sum-exp is kept in float32), got bfloat16",
          *[("dtype", n, torch.bfloat16) for n in ("out", "lse", "q", "k_cache", "v_cache", "k_new", "v_new")]),
    _case("decode_attention", ValueError,
          "argument 'q' must have 3 dims [batch, num_q_heads, head_dim], got 2 dims with shape [2, 32]",
          ("shape", "q", (B, HQ * D))),
    _case("decode_attention", ValueError,
          "argument 'k_cache' must have 4 dims [num_blocks, block_size, num_kv_heads, head_dim], "
          "got 3 dims with shape [16, 2, 8]",
          ("shape", "k_cache", (NUM_BLOCKS * BLOCK_SIZE, HK, D))),
    _case("decode_attention", ValueError,
          "argument 'block_tables' must have 2 dims [batch, max_blocks_per_seq], got 1 dims with shape [4]",
          ("shape", "block_tables", (B * MAX_BLOCKS,))),
    _case("decode_attention", ValueError, "argument 'seq_lens' must have 1 dims [batch], got 2 dims with shape [2, 1]",
          ("shape", "seq_lens", (B, 1))),
    _case("decode_attention", ValueError,
          "argument 'k_new' must have 3 dims [batch, num_kv_heads, head_dim], got 2 dims with shape [2, 16]",
          ("shape", "k_new", (B, HK * D))),
    _case("decode_attention", ValueError, "argument 'lse' must have shape [2, 4] (batch, num_q_heads), got [2]",
          ("shape", "lse", (B,))),
    _case("decode_attention", ValueError, "argument 'k_cache' dim 3 (head_dim, as in q) must be 8, got 4",
          ("shape", "k_cache", (NUM_BLOCKS, BLOCK_SIZE, HK, 4))),
    _case("decode_attention", ValueError,
          "argument 'v_cache' must have the shape of 'k_cache' [4, 4, 2, 8], got [3, 4, 2, 8]",
          ("shape", "v_cache", (3, BLOCK_SIZE, HK, D))),
    # GQA: 4 query heads cannot share 3 kv heads
    _case("decode_attention", ValueError,
          "num_q_heads (q dim 1) = 4 must be a multiple of num_kv_heads (k_cache dim 2) = 3",
          ("shape", "k_cache", (NUM_BLOCKS, BLOCK_SIZE, 3, D)), ("shape", "v_cache", (NUM_BLOCKS, BLOCK_SIZE, 3, D))),
    _case("decode_attention", ValueError, "argument 'k_cache' dim 1 (block_size) must be >= 1, got 0",
          ("shape", "k_cache", (NUM_BLOCKS, 0, HK, D)), ("shape", "v_cache", (NUM_BLOCKS, 0, HK, D))),
    _case("decode_attention", ValueError, "argument 'q' dim 2 (head_dim) must be >= 1, got 0",
          ("shape", "q", (B, HQ, 0)), ("shape", "out", (B, HQ, 0))),
    _case("decode_attention", ValueError, "argument 'block_tables' dim 0 (batch, as in q) must be 2, got 3",
          ("shape", "block_tables", (3, MAX_BLOCKS))),
    _case("decode_attention", ValueError, "argument 'seq_lens' dim 0 (batch, as in q) must be 2, got 3",
          ("shape", "seq_lens", (3,))),
    _case("decode_attention", ValueError, "argument 'k_new' dim 0 (batch, as in q) must be 2, got 3",
          ("shape", "k_new", (3, HK, D))),
    _case("decode_attention", ValueError, "argument 'k_new' dim 1 (num_kv_heads, as in k_cache) must be 2, got 1",
          ("shape", "k_new", (B, 1, D))),
    _case("decode_attention", ValueError, "argument 'v_new' dim 1 (num_kv_heads, as in k_cache) must be 2, got 4",
          ("shape", "v_new", (B, HQ, D))),
    _case("decode_attention", ValueError, "argument 'v_new' dim 2 (head_dim, as in q) must be 8, got 4",
          ("shape", "v_new", (B, HK, 4))),
    _case("decode_attention", ValueError, "argument 'out' must have the shape of 'q' [2, 4, 8], got [2, 4, 4]",
          ("shape", "out", (B, HQ, 4))),
    _case("decode_attention", ValueError, "argument 'lse' must have shape [2, 4] (batch, num_q_heads), got [4, 2]",
          ("shape", "lse", (HQ, B))),
    _case("decode_attention", ValueError,
          "argument 'q' must have a contiguous last dim (stride 1), got strides [64, 16, 2]",
          ("last_dim", "q")),
    _case("decode_attention", ValueError,
          "argument 'k_new' must have a contiguous last dim (stride 1), got strides [32, 16, 2]",
          ("last_dim", "k_new")),
    _case("decode_attention", ValueError,
          "argument 'v_new' must have a contiguous last dim (stride 1), got strides [32, 16, 2]",
          ("last_dim", "v_new")),
    _case("decode_attention", ValueError,
          "argument 'out' must have a contiguous last dim (stride 1), got strides [64, 16, 2]",
          ("last_dim", "out")),
    _case("decode_attention", ValueError,
          "argument 'block_tables' must have a contiguous last dim (stride 1), got strides [4, 2]",
          ("last_dim", "block_tables")),
    _case("decode_attention", ValueError,
          "argument 'k_cache' must be contiguous, got shape [4, 4, 2, 8] with strides [67, 16, 8, 1]",
          ("rows", "k_cache")),
    _case("decode_attention", ValueError,
          "argument 'v_cache' must be contiguous, got shape [4, 4, 2, 8] with strides [67, 16, 8, 1]",
          ("rows", "v_cache")),
    _case("decode_attention", ValueError, "argument 'seq_lens' must be contiguous, got shape [2] with strides [4]",
          ("rows", "seq_lens")),
    _case("decode_attention", ValueError, "argument 'lse' must be contiguous, got shape [2, 4] with strides [7, 1]",
          ("rows", "lse")),
    _case("decode_attention", ValueError, "arguments 'k_new' and 'v_new' must be given together, got k_new only",
          ("set", "v_new", None)),
    _case("decode_attention", ValueError, "arguments 'k_new' and 'v_new' must be given together, got v_new only",
          ("set", "k_new", None)),
    _case("decode_attention", ValueError, "argument 'num_splits' must be in [1, 1024] (or 0/None for the heuristic), "
          "got -1", ("set", "num_splits", -1)),
    _case("decode_attention", ValueError, "argument 'num_splits' must be in [1, 1024] (or 0/None for the heuristic), "
          "got 4294967296", ("set", "num_splits", 2**32)),
    _case("decode_attention", ValueError, "argument 'window' must be >= 0 (0: no window), got -3",
          ("set", "window", -3)),
    # extend_attention(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window)
    _case("extend_attention", TypeError, "argument 'q' must be float32, float16 or bfloat16, got int32",
          ("dtype", "q", torch.int32)),
    _case("extend_attention", TypeError, "argument 'k_cache' must have the dtype of 'q' (float32), got float16",
          ("dtype", "k_cache", torch.float16)),
    _case("extend_attention", TypeError, "argument 'query_start_loc' must be int32 or int64, got float32",
          ("dtype", "query_start_loc", torch.float32)),
    _case("extend_attention", TypeError, "argument 'out' must have the dtype of 'q' (float32), got bfloat16",
          ("dtype", "out", torch.bfloat16)),
    _case("extend_attention", ValueError,
          "argument 'q' must have 3 dims [num_tokens, num_q_heads, head_dim], got 2 dims with shape [3, 32]",
          ("shape", "q", (T, HQ * D))),
    _case("extend_attention", ValueError, "argument 'seq_lens' dim 0 (num_seqs, as in block_tables) must be 2, got 3",
          ("shape", "seq_lens", (3,))),
    _case("extend_attention", ValueError,
          "argument 'query_start_loc' dim 0 (num_seqs + 1, as in block_tables) must be 3, got 2",
          ("shape", "query_start_loc", (2,))),
    _case("extend_attention", ValueError, "argument 'out' must have the shape of 'q' [3, 4, 8], got [3, 4, 4]",
          ("shape", "out", (T, HQ, 4))),
    _case("extend_attention", ValueError, "num_q_heads (q dim 1) = 3 must be a multiple of num_kv_heads (k_cache "
          "dim 2) = 2", ("shape", "q", (T, 3, D)), ("shape", "out", (T, 3, D))),
    _case("extend_attention", ValueError, "argument 'q' must have a contiguous last dim (stride 1), got strides "
          "[64, 16, 2]", ("last_dim", "q")),
    _case("extend_attention", ValueError, "argument 'seq_lens' must be contiguous, got shape [2] with strides [4]",
          ("rows", "seq_lens")),
    _case("extend_attention", ValueError, "argument 'window' must be >= 0 (0: no window), got -3",
          ("set", "window", -3)),
    # merge_attn_states(out, lse, out_a, lse_a, out_b, lse_b)
    _case("merge_attn_states", TypeError, "argument 'out_a' must be float32, float16 or bfloat16, got int32",
          ("dtype", "out_a", torch.int32)),
    _case("merge_attn_states", TypeError, "argument 'out_b' must have the dtype of 'out_a' (float32), got float16",
          ("dtype", "out_b", torch.float16)),
    _case("merge_attn_states", TypeError, "argument 'out' must have the dtype of 'out_a' (float32), got bfloat16",
          ("dtype", "out", torch.bfloat16)),
    _case("merge_attn_states", TypeError, "argument 'lse_a' must be float32 (log-sum-exp is kept in float32), got float16",
          ("dtype", "lse_a", torch.float16)),
    _case("merge_attn_states", TypeError,
          "argument 'lse_b' must be float32 (log-sum-exp is kept in float32), got bfloat16",
          ("dtype", "lse_b", torch.bfloat16)),
    _case("merge_attn_states", TypeError, "argument 'lse' must be float32 (log-sum-exp is kept in float32), got float64",
          ("dtype", "lse", torch.float64)),
    _case("merge_attn_states", ValueError,
          "argument 'out_a' must have 3 dims [num_tokens, num_heads, head_dim], got 2 dims with shape [3, 32]",
          ("shape", "out_a", (T, HQ * D))),
    _case("merge_attn_states", ValueError, "argument 'lse_a' must have shape [3, 4] (num_tokens, num_heads), got [3]",
          ("shape", "lse_a", (T,))),
    _case("merge_attn_states", ValueError, "argument 'out_b' must have the shape of 'out_a' [3, 4, 8], got [3, 2, 8]",
          ("shape", "out_b", (T, 2, D))),
    _case("merge_attn_states", ValueError, "argument 'out' must have the shape of 'out_a' [3, 4, 8], got [2, 4, 8]",
          ("shape", "out", (2, HQ, D))),
    _case("merge_attn_states", ValueError,
          "argument 'lse_b' must have shape [3, 4] (num_tokens, num_heads), got [4, 3]",
          ("shape", "lse_b", (HQ, T))),
    _case("merge_attn_states", ValueError,
          "argument 'lse' must have shape [3, 4] (num_tokens, num_heads), got [3, 4, 1]",
          ("shape", "lse", (T, HQ, 1))),
    _case("merge_attn_states", ValueError,
          "argument 'out_a' must have a contiguous last dim (stride 1), got strides [64, 16, 2]",
          ("last_dim", "out_a")),
    _case("merge_attn_states", ValueError,
          "argument 'out_b' must have a contiguous last dim (stride 1), got strides [64, 16, 2]",
          ("last_dim", "out_b")),
    _case("merge_attn_states", ValueError,
          "argument 'out' must have a contiguous last dim (stride 1), got strides [64, 16, 2]", ("last_dim", "out")),
    _case("merge_attn_states", ValueError, "argument 'lse' must be contiguous, got shape [3, 4] with strides [7, 1]",
          ("rows", "lse")),
    # dense_linear(out, x, weight, bias)
    _case("dense_linear", TypeError, "argument 'x' must be float32, float16 or bfloat16, got int32",
          ("dtype", "x", torch.int32)),
    _case("dense_linear", TypeError, "argument 'weight' must have the dtype of 'x' (float32), got float16",
          ("dtype", "weight", torch.float16)),
    _case("dense_linear", TypeError, "argument 'out' must have the dtype of 'x' (float32), got bfloat16",
          ("dtype", "out", torch.bfloat16)),
    _case("dense_linear", TypeError, "argument 'bias' must have the dtype of 'x' (float32), got float64",
          ("dtype", "bias", torch.float64)),
    _case("dense_linear", ValueError, "argument 'weight' must have 2 dims [out_features, in_features], got 1 dims "
          "with shape [120]", ("shape", "weight", (120,))),
    _case("dense_linear", ValueError, "argument 'weight' dim 1 (in_features, x's last dim) must be 20, got 19 (shape "
          "[6, 19])", ("shape", "weight", (6, 19))),
    _case("dense_linear", ValueError, "argument 'weight' must have in_features >= 1, got shape [6, 0]",
          ("shape", "x", (T, 0)), ("shape", "weight", (6, 0))),
    _case("dense_linear", ValueError, "argument 'out' must have shape [3, 6] (x's leading dims, out_features), got "
          "[3, 7]", ("shape", "out", (T, 7))),
    _case("dense_linear", ValueError, "argument 'bias' dim 0 (out_features) must be 6, got 5", ("shape", "bias", (5,))),
    _case("dense_linear", ValueError, "argument 'x' must have a contiguous last dim (stride 1)", ("last_dim", "x")),
    _case("dense_linear", ValueError, "argument 'out' must have a contiguous last dim (stride 1)", ("last_dim", "out")),
    _case("dense_linear", ValueError, "argument 'weight' must be contiguous, got shape [6, 20] with strides [23, 1]",
          ("rows", "weight")),
    _case("dense_linear", ValueError, "argument 'bias' must be contiguous", ("last_dim", "bias")),
    # quant_linear(out, x, qweight, qtype, bias)
    _case("quant_linear", TypeError, "argument 'x' must be float32, float16 or bfloat16, got int32",
          ("dtype", "x", torch.int32)),
    _case("quant_linear", TypeError, "argument 'qweight' must be uint8 (the raw GGUF blocks), got int8",
          ("dtype", "qweight", torch.int8)),
    _case("quant_linear", TypeError, "argument 'out' must have the dtype of 'x' (float32), got bfloat16",
          ("dtype", "out", torch.bfloat16)),
    _case("quant_linear", TypeError, "argument 'bias' must have the dtype of 'x' (float32), got float16",
          ("dtype", "bias", torch.float16)),
    _case("quant_linear", ValueError, "argument 'x' last dim (in_features) must be a positive multiple of Q4_1's block of 32",
          ("shape", "x", (T, 40))),
    _case("quant_linear", ValueError, "argument 'qweight' dim 1 (bytes per row) must be in_features / 32 * 20 = 40",
          ("shape", "qweight", (6, 36))),
    _case("quant_linear", ValueError, "argument 'out' must have shape [3, 6] (x's leading dims, out_features)",
          ("shape", "out", (T, 7))),
    _case("quant_linear", ValueError, "argument 'bias' dim 0 (out_features) must be 6, got 5",
          ("shape", "bias", (5,))),
    _case("quant_linear", ValueError, "argument 'x' must have a contiguous last dim (stride 1)", ("last_dim", "x")),
    _case("quant_linear", ValueError, "argument 'qweight' must be contiguous", ("rows", "qweight")),
    _case("quant_linear", ValueError, "argument 'bias' must be contiguous", ("last_dim", "bias")),
    # quant_linear_int8: the same checks, under its own name
    _case("quant_linear_int8", TypeError, "argument 'x' must be float32, float16 or bfloat16, got int32",
          ("dtype", "x", torch.int32)),
    _case("quant_linear_int8", TypeError, "argument 'qweight' must be uint8 (the packed panels of quant_pack_int8), "
          "got int8", ("dtype", "qweight", torch.int8)),
    _case("quant_linear_int8", ValueError, "argument 'qweight' must be the packed panels [ceil(out_features / 16), "
          "in_features / 32 * 320] = [1, 640] for Q4_1 with in_features=64 and out_features=6 (out's last dim), got "
          "shape [1, 600]", ("shape", "qweight", (1, 600))),
    _case("quant_linear_int8", ValueError, "argument 'qweight' must be contiguous", ("last_dim", "qweight")),
    _case("quant_linear_int8", ValueError, "argument 'out' must have shape [3, 6] (x's leading dims, out_features)",
          ("shape", "out", (T + 1, 6))),
    _case("quant_linear_int8", ValueError, "argument 'bias' dim 0 (out_features) must be 7, got 6",
          ("shape", "out", (T, 7))),
    _case("quant_linear_int8", ValueError, "argument 'x' must have a contiguous last dim (stride 1)", ("last_dim", "x")),
    # apply_token_bitmask(logits, bitmask, rows)
    _case("apply_token_bitmask", TypeError, "argument 'logits' must be float32, float16 or bfloat16, got int32",
          ("dtype", "logits", torch.int32)),
    _case("apply_token_bitmask", TypeError, "argument 'bitmask' must be int32 (32 tokens to a word), got int64",
          ("dtype", "bitmask", torch.int64)),
    _case("apply_token_bitmask", TypeError, "argument 'rows' must be int32 or int64, got float32",
          ("dtype", "rows", torch.float32)),
    _case("apply_token_bitmask", ValueError, "argument 'logits' must have 2 dims [batch, vocab], got 1 dims with "
          "shape [210]", ("shape", "logits", (T * 70,))),
    _case("apply_token_bitmask", ValueError, "argument 'bitmask' must have 2 dims [num_rows, num_words], got 1 dims "
          "with shape [2]", ("shape", "bitmask", (2,))),
    _case("apply_token_bitmask", ValueError, "argument 'rows' dim 0 (num_rows, as in bitmask) must be 2, got 3",
          ("shape", "rows", (3,))),
    _case("apply_token_bitmask", ValueError, "argument 'logits' must have a contiguous last dim (stride 1)",
          ("last_dim", "logits")),
    _case("apply_token_bitmask", ValueError, "argument 'bitmask' must be contiguous", ("rows", "bitmask")),
    _case("apply_token_bitmask", ValueError, "rows[1] = 3 is not a row of logits (batch 3)", ("set", "rows", torch.tensor([0, 3]))),
    # quant_pack_int8(qweight, qtype)
    _case("quant_pack_int8", TypeError, "argument 'qweight' must be uint8 (the raw GGUF blocks), got int8",
          ("dtype", "qweight", torch.int8)),
    _case("quant_pack_int8", ValueError, "argument 'qweight' must be contiguous [rows, blocks * 20] (Q4_1 blocks), got "
          "shape [6, 30]", ("shape", "qweight", (6, 30))),
    _case("quant_pack_int8", ValueError, "argument 'qweight' must be contiguous [rows, blocks * 20] (Q4_1 blocks), got "
          "shape [6, 40] and strides [43, 1]", ("rows", "qweight")),
]


def _assert_rejected(op: str, args: dict, exc: type, fragment: str) -> None:
    """The call raises ``exc`` whose message starts with the op and contains ``fragment``,
    and no tensor it was given (in-place outputs included) has changed."""
    before = {n: t.clone() for n, t in args.items() if isinstance(t, torch.Tensor) and not t.is_meta}
    with pytest.raises(exc, match=rf"^stagewise\.{op}: .*{re.escape(fragment)}"):
        getattr(torch.ops.stagewise, op)(**args)
    for name, t in before.items():
        assert torch.equal(args[name], t), f"stagewise.{op}: argument '{name}' was changed by a rejected call"


@pytest.mark.parametrize("op, edits, exc, fragment", CASES)
def test_rejected(op, edits, exc, fragment):
    args = VALID[op]("cpu")
    for edit in edits:
        _apply(args, *edit)
    _assert_rejected(op, args, exc, fragment)


def test_every_op_has_each_kind_of_case():
    """Every public op is covered, each with dtype, shape and stride cases."""
    kinds = {op: set() for op in ops.__all__}
    for case in CASES:
        op, edits = case.values[:2]
        kinds[op].update(e[0] for e in edits)
    for op in ops.__all__:
        assert {"dtype", "shape"} <= kinds[op] and kinds[op] & {"last_dim", "rows"}, (op, kinds[op])
    assert set(VALID) == set(DEVICE_REF) == set(ops.__all__)


# ---------------------------------------------------------------------------
# Devices: every tensor argument must be on the device of the op's reference
# argument. Without a GPU the second device is "meta": the dispatcher then runs
# the fake implementation, which checks this too.

DEVICE_CASES = [
    pytest.param(op, name, id=f"{op}-{name}")
    for op, make in VALID.items()
    for name, value in make("meta").items()
    if isinstance(value, torch.Tensor) and name != DEVICE_REF[op]
]

DEVICE_PAIRS = [
    pytest.param("cpu", "meta", id="cpu+meta"),
    pytest.param(
        "cuda", "cpu", id="cuda+cpu",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")],
    ),
]


@pytest.mark.parametrize("base, other", DEVICE_PAIRS)
@pytest.mark.parametrize("op, name", DEVICE_CASES)
def test_wrong_device(op, name, base, other):
    args = VALID[op](base)
    args[name] = args[name].to(other)
    ref = DEVICE_REF[op]
    fragment = f"argument '{name}' must be on the device of '{ref}' ({args[ref].device}), got {other}"
    _assert_rejected(op, args, ValueError, fragment)


# ---------------------------------------------------------------------------
# Checks of the Python wrappers (stagewise.ops) before they reach the op.


@pytest.mark.parametrize("num_splits", [0, -2])
def test_decode_attention_num_splits(num_splits):
    a = _decode_attention("cpu")
    message = rf"^stagewise\.decode_attention: argument 'num_splits' must be >= 1 or None, got {num_splits}$"
    with pytest.raises(ValueError, match=message):
        ops.decode_attention(a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], a["scale"],
                             a["k_new"], a["v_new"], num_splits=num_splits)


@pytest.mark.parametrize("window", [0, -1, True, 2.0])
def test_decode_attention_window(window):
    a = _decode_attention("cpu")
    message = rf"^stagewise\.decode_attention: argument 'window' must be an int >= 1 or None, got {window!r}$"
    with pytest.raises(ValueError, match=message):
        ops.decode_attention(a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], a["scale"],
                             a["k_new"], a["v_new"], window=window)


def test_rope_rotary_dim_mismatch():
    a = _rope("cpu")
    q, k = a["q"].clone(), a["k"].clone()
    message = r"^stagewise\.rope: argument 'rotary_dim' must equal cos_sin_cache\.size\(1\)=8, got 6$"
    with pytest.raises(ValueError, match=message):
        ops.rope(a["q"], a["k"], a["positions"], a["cos_sin_cache"], True, rotary_dim=6)
    assert torch.equal(a["q"], q) and torch.equal(a["k"], k)

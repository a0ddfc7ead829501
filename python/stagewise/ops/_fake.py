"""Fake (meta) implementations: shapes only, so the ops trace under torch.compile.

A call that mixes devices reaches these instead of a real kernel when one of
its tensors is on "meta" (the dispatcher picks the Meta kernel), and a fake
tensor may carry any device, so the one-device rule of the C++ glue
(csrc/bindings/params.cpp) is checked here as well, with the same message.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from stagewise.ops.qtypes import QUANT_BLOCK_BYTES, QUANT_PACK_RECORD_BYTES


def _fake(op: str, ref: str) -> Callable:
    """Register the decorated function as the fake of ``stagewise::<op>``, after checking
    that every tensor argument is on the device of argument ``ref`` (as the C++ glue does)."""

    def register(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            tensors = {n: v for n, v in arguments.items() if isinstance(v, torch.Tensor)}  # k_new=None is no tensor
            device = tensors[ref].device
            for name, t in tensors.items():
                if t.device != device:
                    raise ValueError(
                        f"stagewise.{op}: argument '{name}' must be on the device of '{ref}' ({device}), got {t.device}"
                    )
            return fn(*args, **kwargs)

        torch.library.register_fake(f"stagewise::{op}")(checked)
        return fn

    return register


@_fake("rms_norm", ref="x")
def _rms_norm(out, x, weight, eps, unit_offset=False):
    return None


@_fake("fused_add_rms_norm", ref="x")
def _fused_add_rms_norm(x, residual, weight, eps, unit_offset=False):
    return None


@_fake("rope", ref="q")
def _rope(q, k, positions, cos_sin_cache, is_neox):
    return None


@_fake("qk_norm_rope", ref="q")
def _qk_norm_rope(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox, unit_offset=False):
    return None


@_fake("reshape_and_cache", ref="k")
def _reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    return None


@_fake("slot_mapping", ref="block_tables")
def _slot_mapping(block_tables, seq_index, positions, block_size, cp_world_size, cp_rank, interleave_size):
    # [num_tokens] int64 on the inputs' device, as the kernels allocate it.
    return positions.new_empty(positions.shape, dtype=torch.int64)


@_fake("decode_attention", ref="q")
def _decode_attention(out, lse, q, k_cache, v_cache, block_tables, seq_lens, scale, k_new, v_new, num_splits,
                      window=0, k_scale=None, v_scale=None):
    return None


@_fake("extend_attention", ref="q")
def _extend_attention(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window=0,
                      k_scale=None, v_scale=None):
    return None


@_fake("merge_attn_states", ref="out_a")
def _merge_attn_states(out, lse, out_a, lse_a, out_b, lse_b):
    return None


@_fake("apply_token_bitmask", ref="logits")
def _apply_token_bitmask(logits, bitmask, rows):
    return None


@_fake("dense_linear", ref="x")
def _dense_linear(out, x, weight, bias):
    return None


@_fake("quant_linear", ref="x")
def _quant_linear(out, x, qweight, qtype, bias):
    return None


@_fake("quant_linear_int8", ref="x")
def _quant_linear_int8(out, x, qweight, qtype, bias):
    return None


@_fake("quant_pack_int8", ref="qweight")
def _quant_pack_int8(qweight, qtype):
    blocks = qweight.shape[1] // QUANT_BLOCK_BYTES[qtype]
    return qweight.new_empty(((qweight.shape[0] + 15) // 16, blocks * QUANT_PACK_RECORD_BYTES[qtype]))

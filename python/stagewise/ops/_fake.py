"""Fake (meta) implementations: shapes only, so the ops trace under torch.compile."""

from __future__ import annotations

import torch


@torch.library.register_fake("stagewise::rms_norm")
def _rms_norm(out, x, weight, eps):
    return None


@torch.library.register_fake("stagewise::fused_add_rms_norm")
def _fused_add_rms_norm(x, residual, weight, eps):
    return None


@torch.library.register_fake("stagewise::rope")
def _rope(q, k, positions, cos_sin_cache, is_neox):
    return None


@torch.library.register_fake("stagewise::qk_norm_rope")
def _qk_norm_rope(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox):
    return None


@torch.library.register_fake("stagewise::reshape_and_cache")
def _reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    return None


@torch.library.register_fake("stagewise::slot_mapping")
def _slot_mapping(block_tables, seq_index, positions, block_size, cp_world_size, cp_rank, interleave_size):
    return positions.new_empty(positions.shape, dtype=torch.int64)


@torch.library.register_fake("stagewise::decode_attention")
def _decode_attention(out, lse, q, k_cache, v_cache, block_tables, seq_lens, scale, k_new, v_new, num_splits):
    return None


@torch.library.register_fake("stagewise::merge_attn_states")
def _merge_attn_states(out, lse, out_a, lse_a, out_b, lse_b):
    return None

"""Rotary position embedding: the ``cos_sin_cache`` table that :func:`stagewise.ops.rope` reads, and
:class:`Rotary`, which applies it to q and k.

Every step is done in float32 in the order transformers does it
(``modeling_rope_utils``, and the models' ``RotaryEmbedding.forward``), so the
tables match HF's cos/sin to the last bit or so; a cache built in the model's
dtype rounds once, as HF's ``cos.to(x.dtype)`` does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from stagewise import ops
from stagewise.model.config import ModelConfig, RopeConfig


def rope_frequencies(rope: RopeConfig, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` (float32, CPU) and the factor that scales cos and sin."""
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rope_frequencies: rotary_dim must be even and >= 2, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        inv_freq = _llama3(inv_freq, rope)
    elif rope.type == "yarn":
        inv_freq = _yarn(exponents, rotary_dim, rope)
    return inv_freq, rope.attention_factor


def cos_sin_cache(
    config: ModelConfig,
    max_position: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``[max_position, rotary_dim]``: cos of each position's angles in the first half, sin in the second.

    Build it in float32, or in the model's dtype to round as HF does when it runs in that dtype.
    """
    if isinstance(max_position, bool) or not isinstance(max_position, int) or max_position <= 0:
        raise ValueError(f"cos_sin_cache: max_position must be a positive integer, got {max_position!r}")
    inv_freq, scale = rope_frequencies(config.rope, config.rotary_dim)
    positions = torch.arange(max_position, device=device, dtype=torch.int64).to(torch.float32)
    angles = positions[:, None] * inv_freq.to(device)[None, :]
    # HF multiplies by its attention scaling even when it is 1, which changes nothing.
    return torch.cat([angles.cos() * scale, angles.sin() * scale], dim=1).to(dtype)


def mrope_axes(section: tuple[int, int, int], rotary_dim: int) -> torch.Tensor:
    """``[rotary_dim // 2]`` int64: the position axis (0 temporal, 1 height, 2 width) each frequency
    of Qwen3-VL's interleaved M-RoPE reads: ``t h w t h w ...``, height on frequencies ``3i + 1 <
    3 * section[1]``, width on ``3i + 2 < 3 * section[2]``, temporal on the rest."""
    j = torch.arange(rotary_dim // 2)
    axes = torch.zeros_like(j)
    axes[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axes


class Rotary(nn.Module):
    """Rotary embedding of q and k in place, with Qwen3's per-head q/k RMSNorm fused in when given.

    With ``mrope_section`` in the config (Qwen3-VL) a step may bring 3-D positions: each token's
    cos/sin row is then gathered from the same table, frequency by frequency from the position of
    the axis that frequency reads (:func:`mrope_axes`), and the ops rotate by those rows. A token
    whose three positions are equal gets the plain row of that position."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        # The table in the model's dtype rounds cos/sin as HF's ``cos.to(x.dtype)`` does.
        self.register_buffer("cos_sin_cache", cos_sin_cache(config, config.max_position_embeddings, dtype, device),
                             persistent=False)
        self.is_neox = config.rope.is_neox
        self.eps = config.norm_eps
        section = config.rope.mrope_section
        axes = None if section is None else mrope_axes(section, config.rotary_dim).to(device)
        self.register_buffer("mrope_axes", axes, persistent=False)

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """``[T, rotary_dim]`` cos/sin rows of 3-D ``positions [3, T]`` (Qwen3-VL's M-RoPE)."""
        if self.mrope_axes is None:
            raise ValueError("Rotary.rows: the model has no mrope_section; its positions are one-dimensional")
        half = self.mrope_axes.numel()
        picked = positions.index_select(0, self.mrope_axes)  # [half, T]: each frequency's axis
        cos = self.cos_sin_cache[:, :half].gather(0, picked.t())
        sin = self.cos_sin_cache[:, half:].gather(0, picked.t())
        return torch.cat([cos, sin], dim=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                rows: torch.Tensor | None = None, *, unit_offset: bool = False) -> None:
        """``q [T, Hq, D]``, ``k [T, Hk, D]`` rotated in place at ``positions [T]``, or by ``rows
        [T, rotary_dim]`` (from :meth:`rows`) when given; ``q_norm/k_norm [D]`` or None, scaling by
        ``1 + w`` with ``unit_offset`` (Gemma's)."""
        table = self.cos_sin_cache
        if rows is not None:
            table, positions = rows, torch.arange(rows.size(0), device=rows.device)
        if q_norm is None:
            ops.rope(q, k, positions, table, self.is_neox)
        else:
            ops.qk_norm_rope(q, k, q_norm, k_norm, positions, table, self.eps, self.is_neox, unit_offset=unit_offset)


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(exponents: torch.Tensor, rotary_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: interpolate slow dimensions, extrapolate fast ones, with a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the pretraining context.
        context = rope.original_max_position_embeddings
        return rotary_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = rope.theta**exponents
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (rope.factor * pos_freqs)
    return inv_freq_interpolation * (1 - extrapolation) + inv_freq_extrapolation * extrapolation

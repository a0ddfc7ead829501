"""The Qwen3-VL vision tower: patch embedding, learned positions interpolated to each image's grid,
ViT blocks with 2-D rope and per-image attention, the patch merger and the DeepStack mergers.

Which kernel runs what (see docs/model.md, "Qwen3-VL"): the linears are :class:`Linear`
(``F.linear``), the patch embedding is a linear over flattened patches (a Conv3d whose stride is its
kernel is one), the 2-D rope is :func:`stagewise.ops.rope` over per-patch cos/sin rows, LayerNorm
and GELU are torch's (the op library has neither), and attention is torch SDPA, one segment (one
image frame) at a time.

HF names under ``model.visual.``: ``patch_embed.proj``, ``pos_embed``, ``blocks.{i}.{norm1,norm2,
attn.qkv,attn.proj,mlp.linear_fc1,mlp.linear_fc2}``, ``merger.{norm,linear_fc1,linear_fc2}`` and
``deepstack_merger_list.{k}.*`` (the table: :func:`stagewise.model.shapes.vision_tensors`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stagewise import ops
from stagewise.model.config import VisionConfig
from stagewise.model.layers.linear import Linear
from stagewise.model.layers.norm import LayerNorm
from stagewise.model.weights import Weights
from stagewise.model.vision import grid

PREFIX = "model.visual."
_EPS = 1e-6  # every LayerNorm of the tower (fixed in transformers' Qwen3-VL)


def _act(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"vision tower: hidden_act {name!r} is not supported (gelu_pytorch_tanh, gelu, silu)")


def _linear(w: Weights, name: str) -> Linear:
    return Linear(w(name + ".weight"), w(name + ".bias"))


def _layer_norm(w: Weights, name: str) -> LayerNorm:
    return LayerNorm(w(name + ".weight"), w(name + ".bias"), _EPS)


class VisionBlock(nn.Module):
    """``h += attn(norm1(h)); h += mlp(norm2(h))`` with attention inside each segment only."""

    def __init__(self, v: VisionConfig, w: Weights, p: str) -> None:
        super().__init__()
        self.heads, self.head_dim = v.num_heads, v.head_dim
        self.norm1, self.norm2 = _layer_norm(w, p + "norm1"), _layer_norm(w, p + "norm2")
        self.qkv, self.proj = _linear(w, p + "attn.qkv"), _linear(w, p + "attn.proj")
        self.fc1, self.fc2 = _linear(w, p + "mlp.linear_fc1"), _linear(w, p + "mlp.linear_fc2")
        self.act = _act(v.hidden_act)

    def forward(self, h: torch.Tensor, rope_rows: torch.Tensor, segments: list[int]) -> torch.Tensor:
        n = h.size(0)
        qkv = self.qkv(self.norm1(h)[0]).view(n, 3, self.heads, self.head_dim)
        q, k, v = (qkv[:, i].contiguous() for i in range(3))
        ops.rope(q, k, torch.arange(n, device=h.device), rope_rows, True)
        out = torch.empty_like(q)
        start = 0
        for length in segments:
            # [1, heads, length, D]: torch's CPU SDPA takes its flash kernel for 4-D inputs only
            # (3-D falls back to the unfused maths, ~3x slower at 784 patches).
            qs, ks, vs = (a[start:start + length].transpose(0, 1)[None] for a in (q, k, v))
            out[start:start + length] = F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1)
            start += length
        h = h + self.proj(out.view(n, -1))
        return h + self.fc2(self.act(self.fc1(self.norm2(h)[0])))


class PatchMerger(nn.Module):
    """``merge ** 2`` neighbouring patches -> one token of the text width: LayerNorm (before the
    merge, or after it for the DeepStack mergers), then linear, GELU, linear."""

    def __init__(self, v: VisionConfig, w: Weights, p: str, norm_after_merge: bool) -> None:
        super().__init__()
        self.width, self.norm_after_merge = v.merged_width, norm_after_merge
        self.norm, self.fc1, self.fc2 = _layer_norm(w, p + "norm"), _linear(w, p + "linear_fc1"), _linear(
            w, p + "linear_fc2")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm_after_merge:
            x = self.norm(h.reshape(-1, self.width))[0]
        else:
            x = self.norm(h)[0].reshape(-1, self.width)
        return self.fc2(F.gelu(self.fc1(x)))


class VisionTower(nn.Module):
    """``pixel_values [patches, C * Tp * P * P]`` and ``grid_thw [images, 3]`` -> image token
    embeddings ``[tokens, out_hidden]`` and DeepStack features ``[levels, tokens, out_hidden]``."""

    def __init__(self, v: VisionConfig, w: Weights) -> None:
        super().__init__()
        self.config = v
        self.patch = Linear(w(PREFIX + "patch_embed.proj.weight").reshape(v.hidden_size, -1),
                            w(PREFIX + "patch_embed.proj.bias"))
        self.pos_embed = nn.Parameter(w(PREFIX + "pos_embed.weight"), requires_grad=False)
        self.blocks = nn.ModuleList(VisionBlock(v, w, f"{PREFIX}blocks.{i}.") for i in range(v.depth))
        self.merger = PatchMerger(v, w, PREFIX + "merger.", norm_after_merge=False)
        self.deepstack = nn.ModuleList(PatchMerger(v, w, f"{PREFIX}deepstack_merger_list.{i}.", True)
                                       for i in range(len(v.deepstack_visual_indexes)))
        quarter = v.head_dim // 4  # frequencies per axis: rows on the first half, columns on the second
        exponents = torch.arange(0, 2 * quarter, 2, dtype=torch.float32) / (2 * quarter)
        self.register_buffer("inv_freq", 1.0 / (v.rope_theta ** exponents), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.dtype

    def _rope_rows(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[patches, head_dim]``: cos of (row angles, column angles), then their sin."""
        pos = grid.rotary_positions(grid_thw, self.config.spatial_merge_size).to(self.inv_freq.device)
        angles = (pos[..., None].float() * self.inv_freq).flatten(1)  # [n, 2 * quarter]: rows then columns
        return torch.cat([angles.cos(), angles.sin()], dim=1).to(self.dtype)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.config
        grid.check_grid(grid_thw, v.spatial_merge_size)
        patches = int(grid_thw.prod(-1).sum())
        if pixel_values.dim() != 2 or pixel_values.shape != (patches, v.patch_features):
            raise ValueError(f"vision tower: pixel_values must be [{patches}, {v.patch_features}] for image_grid_thw "
                             f"{grid_thw.tolist()}, got {list(pixel_values.shape)}")
        grid_cpu = grid_thw.cpu()
        h = self.patch(pixel_values.to(device=self.pos_embed.device, dtype=self.dtype))
        side = int(v.num_position_embeddings**0.5)
        indices, weights = grid.interpolation_taps(grid_cpu, v.spatial_merge_size, side)
        indices, weights = indices.to(h.device), weights.to(h.device)
        h = h + (self.pos_embed[indices] * weights[:, :, None]).sum(1).to(h.dtype)
        rope_rows, segments = self._rope_rows(grid_cpu), grid.attention_segments(grid_cpu)
        features = []
        for i, block in enumerate(self.blocks):
            h = block(h, rope_rows, segments)
            if i in v.deepstack_visual_indexes:
                features.append(self.deepstack[v.deepstack_visual_indexes.index(i)](h))
        embeds = self.merger(h)
        deepstack = torch.stack(features) if features else embeds.new_empty((0, *embeds.shape))
        return embeds, deepstack

"""What an image's patch grid implies, from ``grid_thw`` alone (no weights): the order of its
patches, their learned-position interpolation taps, their 2-D rotary positions and the attention
segments of the ViT.

``grid_thw [n, 3]`` holds per image (or video) its temporal, height and width patch counts. Patches
come in spatial-merge-block order: each ``merge x merge`` block of neighbouring patches is
consecutive, so that the merger can view ``merge ** 2`` rows as one token. Every function here
gives the same numbers as transformers' ``vision_utils`` for Qwen3-VL.
"""

from __future__ import annotations

import torch


def check_grid(grid_thw: torch.Tensor, merge: int) -> None:
    """ValueError unless ``grid_thw`` is ``[n, 3]`` integers, positive, with height and width multiples
    of ``merge``."""
    if grid_thw.dim() != 2 or grid_thw.size(1) != 3 or grid_thw.is_floating_point():
        raise ValueError(f"image_grid_thw: expected an integer tensor [images, 3], got {grid_thw.dtype} "
                         f"{list(grid_thw.shape)}")
    for i, (t, h, w) in enumerate(grid_thw.tolist()):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(f"image_grid_thw[{i}]: expected positive (t, h, w) with h and w multiples of the "
                             f"spatial merge size {merge}, got {(t, h, w)}")


def merged_tokens(grid_thw: torch.Tensor, merge: int) -> list[int]:
    """Image tokens of each image: its patches over ``merge ** 2``."""
    return [t * h * w // (merge * merge) for t, h, w in grid_thw.tolist()]


def _block_rows_cols(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch (all images, all frames) in merge-block order."""
    rows, cols = [], []
    for t, h, w in grid_thw.tolist():
        r = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        c = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        rows.append(r.transpose(1, 2).flatten().repeat(t))
        cols.append(c.transpose(1, 2).flatten().repeat(t))
    return torch.cat(rows), torch.cat(cols)


def rotary_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """``[patches, 2]`` int64: the (row, column) of each patch, which the ViT's 2-D rope rotates by."""
    rows, cols = _block_rows_cols(grid_thw, merge)
    return torch.stack([rows, cols], dim=-1)


def interpolation_taps(grid_thw: torch.Tensor, merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [patches, 4] int64, weights [patches, 4] float32)``: the learned ``side x side``
    position table resampled bilinearly (corners aligned) to each image's grid, as four taps per patch
    into the flattened table."""
    rows, cols = _block_rows_cols(grid_thw, merge)
    heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grid_thw.tolist()])
    widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grid_thw.tolist()])
    h_taps, h_weights = _axis_taps(rows, heights, side)
    w_taps, w_weights = _axis_taps(cols, widths, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    # align_corners: the grid's first and last patch sit on the table's first and last entry.
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def attention_segments(grid_thw: torch.Tensor) -> list[int]:
    """Patches of each ViT attention segment: one per frame of each image (``h * w``)."""
    return [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]

"""The images of stage 0's requests: a request's ``pixel_values`` and patch grids checked against
its prompt once, when it is added, and turned into what its steps carry — the image tokens'
embeddings, DeepStack features and 3-D rope positions with each chunk of its prefill, the rope
delta with each decode (see :mod:`stagewise.model.vision.positions`).

The vision tower runs once per request, with its prompt's first chunk; its output is kept until the
prompt's last chunk (an encoder cache), so that a prompt with images is chunked like any other and
never waits for a step of its own.

Checks name the request and the image: the model must have a vision tower, each image's grid must
fit the tower, and the prompt must hold one run of ``t * h * w / merge ** 2`` image placeholder
tokens per image, in order.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from stagewise.model.config import ModelConfig
from stagewise.model.vision.grid import merged_tokens
from stagewise.model.vision.positions import rope_positions


@dataclass(kw_only=True, slots=True)
class ImageInputs:
    """A request's images as the vision tower takes them (the image processor's output)."""

    pixel_values: torch.Tensor
    """``[patches, C * Tp * P * P]`` float: every image's flattened patches, image after image."""
    image_grid_thw: torch.Tensor
    """``[images, 3]`` int64: each image's (t, h, w) patch grid."""

    def __post_init__(self) -> None:
        if not isinstance(self.pixel_values, torch.Tensor) or not isinstance(self.image_grid_thw, torch.Tensor):
            raise ValueError("ImageInputs: pixel_values and image_grid_thw must be tensors, got "
                             f"{type(self.pixel_values).__name__} and {type(self.image_grid_thw).__name__}")
        if self.image_grid_thw.dim() == 1:
            self.image_grid_thw = self.image_grid_thw.view(1, -1)

    @property
    def num_images(self) -> int:
        return self.image_grid_thw.size(0)


@dataclass(kw_only=True, slots=True)
class VisionRequest:
    """What the engine keeps of a request with images (or of any request to a multimodal model)."""

    positions: torch.Tensor
    """``[3, prompt_len]`` int64 rope positions of the prompt."""
    delta: int
    """Decode position = cached tokens + delta."""
    images: ImageInputs
    """Its images, for the vision tower."""
    token_index: torch.Tensor
    """``[N]`` int64: the prompt indices of its image placeholder tokens, in order."""
    tokens_per_image: tuple[int, ...]
    """Placeholder tokens of each image (one run each, in order)."""
    digests: tuple[tuple[int, int, bytes], ...] | None = None
    """Per image, once prefix caching asked: its tokens' span ``[start, end)`` and its content hash."""
    features: tuple[torch.Tensor, torch.Tensor] | None = None
    """The vision tower's output while the prompt is being prefilled: the image tokens' embeddings
    ``[N, hidden]`` and DeepStack features ``[levels, N, hidden]``; None before and after."""

    def chunk_features(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For prompt tokens ``[start, start + length)``: the indices of the image tokens among them
        (relative to ``start``), their embeddings and their DeepStack features."""
        if self.features is None:
            raise ValueError("VisionRequest.chunk_features: the images are not encoded")
        idx = self.token_index
        mask = (idx >= start) & (idx < start + length)
        embeds, deepstack = self.features
        return idx[mask] - start, embeds[mask.to(embeds.device)], deepstack[:, mask.to(deepstack.device)]


def prepare_images(config: ModelConfig, request_id: Hashable, prompt_ids: list[int],
                   images: ImageInputs | None) -> VisionRequest | None:
    """The :class:`VisionRequest` of a request; None for a text-only prompt, which needs none.
    ValueError naming the request (and the image) when the images do not fit the model or the prompt."""
    v = config.vision_config
    if v is None:
        if images is not None and images.num_images:
            raise ValueError(f"request {request_id!r}: {images.num_images} image(s) given, but the model is text-only "
                             f"({config.architecture}, no vision tower)")
        return None
    grids: list[tuple[int, int, int]] = []
    if images is not None:
        grid, pixels = images.image_grid_thw, images.pixel_values
        if grid.dim() != 2 or grid.size(1) != 3 or grid.is_floating_point():
            raise ValueError(f"request {request_id!r}: image_grid_thw must be an integer tensor [images, 3], "
                             f"got {grid.dtype} {list(grid.shape)}")
        merge = v.spatial_merge_size
        for i, (t, h, w) in enumerate(grid.tolist()):
            if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
                raise ValueError(f"request {request_id!r}, image {i}: grid (t, h, w) = {(t, h, w)} must be positive "
                                 f"with h and w multiples of the spatial merge size {merge}")
        patches = int(grid.prod(-1).sum())
        if pixels.dim() != 2 or tuple(pixels.shape) != (patches, v.patch_features) or not pixels.is_floating_point():
            raise ValueError(f"request {request_id!r}: pixel_values must be float [{patches}, {v.patch_features}] for "
                             f"image_grid_thw {grid.tolist()}, got {pixels.dtype} {list(pixels.shape)}")
        grids = [tuple(g) for g in grid.tolist()]
    try:
        positions, delta = rope_positions(prompt_ids, grids, v.image_token_id, v.spatial_merge_size)
    except ValueError as err:
        counts = merged_tokens(images.image_grid_thw, v.spatial_merge_size) if images is not None else []
        raise ValueError(f"request {request_id!r}: {err} (image tokens per image: {counts})") from None
    if images is None or images.num_images == 0:
        return None  # text only: every axis at the token's index, as without M-RoPE
    index = (torch.tensor(prompt_ids, dtype=torch.int64) == v.image_token_id).nonzero().flatten()
    return VisionRequest(positions=positions, delta=delta, images=images, token_index=index,
                         tokens_per_image=tuple(merged_tokens(images.image_grid_thw, v.spatial_merge_size)))

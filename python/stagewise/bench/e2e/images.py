"""Image prompts for `stagewise bench e2e --image WxH` on a vision model (Qwen3-VL, such as
``--model random-qwen3-vl``, :mod:`stagewise.bench.e2e.random_models`).

Each row's prompt is one image (its placeholder tokens between vision start and end, as the chat
template puts them) followed by the row's text ids. The image is preprocessed once, outside the
timed calls, and both sides take the same ``pixel_values``: the figures time the vision tower,
the prefill and the decode, not the image decoding.
"""

from __future__ import annotations

import numpy as np
import torch

from stagewise.engine.images import ImageInputs
from stagewise.model.loader import Checkpoint


def image_prompts(ckpt: Checkpoint, prompts: list[list[int]], size: tuple[int, int]
                  ) -> tuple[list[list[int]], ImageInputs]:
    """``prompts`` with one image of ``size`` (width, height) in front of each, and that image's
    inputs (the same for every row)."""
    from PIL import Image

    from stagewise.frontend.image_processing import ImageProcessor

    v = ckpt.config.vision_config
    if v is None:
        raise ValueError(f"bench e2e: --image needs a vision model; {str(ckpt.path)!r} is text-only")
    w, h = size
    gradient = np.add.outer(np.arange(h) * 255 // max(h - 1, 1), np.arange(w) * 255 // max(w - 1, 1)) // 2
    picture = Image.fromarray(np.stack([gradient, gradient[::-1], gradient[:, ::-1]], -1).astype(np.uint8))
    inputs = ImageProcessor.for_model(ckpt.path, v)([picture])
    t, gh, gw = inputs.image_grid_thw[0].tolist()
    placeholders = [v.vision_start_token_id] + [v.image_token_id] * (t * gh * gw // v.spatial_merge_size**2) + [
        v.vision_end_token_id]
    return [placeholders + p for p in prompts], inputs


def transformers_inputs(prompts: list[list[int]], images: ImageInputs, image_token_id: int, device) -> dict:
    """The batch's image inputs as transformers' Qwen3-VL takes them."""
    n = len(prompts)
    ids = torch.tensor(prompts, dtype=torch.int64)
    return dict(pixel_values=images.pixel_values.repeat(n, 1).to(device),
                image_grid_thw=images.image_grid_thw.repeat(n, 1).to(device),
                mm_token_type_ids=(ids == image_token_id).int().to(device))

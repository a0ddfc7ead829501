"""Image prompts for `stagewise bench e2e --image WxH` on a vision model (Qwen3-VL), and the random
Qwen3-VL of a realistic shape that `--model random-qwen3-vl` builds (with transformers, seeded,
saved once in the temp folder).

Each row's prompt is one image (its placeholder tokens between vision start and end, as the chat
template puts them) followed by the row's text ids. The image is preprocessed once, outside the
timed calls, and both sides take the same ``pixel_values``: the figures time the vision tower,
the prefill and the decode, not the image decoding.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from stagewise.engine.images import ImageInputs
from stagewise.model.loader import Checkpoint

RANDOM_VL = "random-qwen3-vl"
# Hidden 2048, 8 decoder layers (GQA 16/8 of 128), ViT of depth 8 (Qwen3-VL's 1152 wide, patch 16)
# with DeepStack at blocks 1, 3, 5; a 32k vocabulary keeps the embedding from dominating.
RANDOM_VL_SHAPE = dict(
    vision=dict(depth=8, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=2048, patch_size=16,
                temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
                deepstack_visual_indexes=[1, 3, 5]),
    text=dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
              head_dim=128, intermediate_size=6144, max_position_embeddings=4096,
              rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20],
                                   mrope_interleaved=True)),
    tokens=dict(image_token_id=31995, video_token_id=31996, vision_start_token_id=31997, vision_end_token_id=31998))
"""The processor's pixel bounds: Qwen3-VL's published ones."""


def random_vl_model(log=print) -> Path:
    """The folder of the random Qwen3-VL (built on first use; float32, bfloat16 stated nowhere)."""
    import transformers

    folder = Path(tempfile.gettempdir()) / f"stagewise-{RANDOM_VL}-v1"
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return folder
    log(f"bench e2e: building {RANDOM_VL} in {folder} (once)")
    torch.manual_seed(0)
    s = RANDOM_VL_SHAPE
    model = transformers.Qwen3VLForConditionalGeneration(
        transformers.Qwen3VLConfig(vision_config=s["vision"], text_config=s["text"], **s["tokens"]))
    model.save_pretrained(folder)
    return folder


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

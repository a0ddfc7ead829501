"""Image preprocessing against transformers' Pillow-based Qwen2-VL/Qwen3-VL image processor:
the same ``pixel_values`` (bit for bit) and ``image_grid_thw`` for odd sizes, tiny images scaled up,
large ones scaled down, and images with alpha, in grey or with a palette; the prompt expansion."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stagewise.frontend.image_processing import ImageProcessor, load_image, smart_resize
from stagewise.model.config import VisionConfig
from stagewise.frontend.prompts import expand_image_placeholders

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

VISION = VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=8, out_hidden_size=8, patch_size=4,
                      num_position_embeddings=16)
SIZES = [(37, 53, "RGB"), (5, 300, "RGB"), (3, 2, "RGB"), (1000, 700, "RGB"), (64, 64, "RGBA"), (33, 17, "L"),
         (640, 481, "P")]


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    folder = tmp_path_factory.mktemp("processor")
    hf = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                  size={"shortest_edge": 1024, "longest_edge": 16384},
                                  image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.25])
    hf.save_pretrained(folder)
    return hf, ImageProcessor.for_model(folder, VISION)


def _image(w: int, h: int, mode: str, seed: int):
    rng = np.random.default_rng(seed)
    if mode == "RGBA":
        return PIL.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
    image = PIL.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
    return image if mode == "RGB" else image.convert(mode)


@pytest.mark.parametrize("w,h,mode", SIZES)
def test_pixel_values_match_transformers(processors, w, h, mode):
    hf, ours = processors
    image = _image(w, h, mode, w * h)
    ref = hf(images=[image], return_tensors="pt")
    got = ours([image])
    assert got.image_grid_thw.tolist() == ref["image_grid_thw"].tolist()
    assert torch.equal(got.pixel_values, ref["pixel_values"])


def test_several_images_and_the_size_bounds(processors):
    hf, ours = processors
    images = [_image(w, h, "RGB", i) for i, (w, h, _) in enumerate(SIZES[:4])]
    ref, got = hf(images=images, return_tensors="pt"), ours(images)
    assert torch.equal(got.pixel_values, ref["pixel_values"])
    assert got.image_grid_thw.tolist() == ref["image_grid_thw"].tolist()
    for t, gh, gw in got.image_grid_thw.tolist():
        assert 1024 <= gh * gw * 16 <= 16384 and gh % 2 == gw % 2 == 0  # within the bounds, on the 8-pixel grid
    assert smart_resize(2, 3, 8, 1024, 16384) == (32, 40)  # tiny: scaled up


def test_defaults_without_a_processor_config():
    p = ImageProcessor.for_model(None, VISION)
    assert (p.patch_size, p.merge_size, p.image_mean, p.min_pixels) == (4, 2, (0.5, 0.5, 0.5), 65536)
    with pytest.raises(ValueError, match="merge_size"):
        ImageProcessor.for_model(None, VISION, merge_size=3)


@pytest.mark.parametrize("keys", [
    {}, {"image_mean": [0.5, 0.4, 0.3]}, {"min_pixels": 2000}, {"max_pixels": 5000},
    {"size": {"shortest_edge": 1024, "longest_edge": 16384}, "min_pixels": 300, "max_pixels": 2000},
], ids=["none", "mean", "min-pixels", "max-pixels", "pixels-over-size"])
def test_left_out_keys_mean_what_transformers_fills_in(tmp_path, keys):
    """A preprocessor_config.json naming only some keys: those left out are transformers' defaults
    (CLIP's mean and std, 3136 to 1003520 pixels), and min_pixels / max_pixels win over size, as
    transformers reads the same file."""
    import json

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, **keys}))
    hf, ours = Qwen2VLImageProcessorPil.from_pretrained(tmp_path), ImageProcessor.for_model(tmp_path, VISION)
    images = [_image(w, h, "RGB", i) for i, (w, h, _) in enumerate(SIZES[:4])]
    ref, got = hf(images=images, return_tensors="pt"), ours(images)
    assert got.image_grid_thw.tolist() == ref["image_grid_thw"].tolist()
    assert torch.equal(got.pixel_values, ref["pixel_values"])


def test_bad_images_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="no image file"):
        load_image(tmp_path / "missing.png")
    (tmp_path / "bad.png").write_bytes(b"GIF89a broken")
    with pytest.raises(ValueError, match="not a readable image"):
        load_image(tmp_path / "bad.png")
    with pytest.raises(ValueError, match=r"uint8 \[H, W, 3\]"):
        load_image(torch.zeros(4, 4, 3))
    with pytest.raises(ValueError, match="above the limit of 100"):
        load_image(torch.zeros(20, 20, 3, dtype=torch.uint8), max_pixels=100)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, 8, 64, 4096)


def test_placeholders_expand_to_one_token_per_merged_patch():
    kw = dict(image_token_id=9, vision_start_id=7, vision_end_id=8)
    assert expand_image_placeholders([1, 7, 9, 8, 2, 7, 9, 8], [2, 3], **kw) == [1, 7, 9, 9, 8, 2, 7, 9, 9, 9, 8]
    assert expand_image_placeholders([1, 7, 9, 9, 8], [2], **kw) == [1, 7, 9, 9, 8]  # already expanded
    assert expand_image_placeholders([1, 2], [1], **kw) == [7, 9, 8, 1, 2]  # none: in front
    with pytest.raises(ValueError, match="1 image placeholder"):
        expand_image_placeholders([7, 9, 8], [1, 1], **kw)
    with pytest.raises(ValueError, match="run has 2 tokens"):
        expand_image_placeholders([9, 9], [3], **kw)

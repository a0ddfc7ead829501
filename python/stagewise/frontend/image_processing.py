"""Images into what the vision tower takes: decoded with Pillow, resized to the model's pixel bounds
on a grid of ``patch_size * merge_size`` pixels, rescaled, normalised and cut into flattened patches
(``pixel_values``) with each image's patch grid (``image_grid_thw``).

The steps, their order and their rounding are those of transformers' Pillow-based Qwen2-VL image
processor, which Qwen3-VL uses, so that both give the same ``pixel_values``: RGB conversion
(transparency composited onto white), ``smart_resize`` of the size, a bicubic Pillow resize of the
uint8 image, ``x * rescale_factor`` in float64 rounded to float32, ``(x - mean) / std`` in float32,
and each patch repeated ``temporal_patch_size`` times (a still image is one frame).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stagewise.engine.images import ImageInputs
from stagewise.model.config import VisionConfig

ImageSource = Any
"""A file path (str or Path), an image file's bytes, a PIL image, or a uint8 tensor / array ``[H, W, 3]``."""


class ImageError(ValueError):
    """An image of a prompt that cannot be used; ``index``: its place among the prompt's images."""

    def __init__(self, message: str, *, index: int) -> None:
        super().__init__(message)
        self.index = index


# What transformers' Qwen2-VL image processor gives the keys a preprocessor_config.json leaves out
# (its patch sizes aside: those follow the vision tower, whose patches they must cut).
HF_DEFAULTS: dict[str, Any] = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
                                   image_mean=(0.48145466, 0.4578275, 0.40821073),
                                   image_std=(0.26862954, 0.26130258, 0.27577711))


@dataclass(kw_only=True, slots=True)
class ImageProcessor:
    """The preprocessing of one model: its ``preprocessor_config.json`` (HF's names, and for keys
    it leaves out transformers' defaults, :data:`HF_DEFAULTS`), or Qwen3-VL's published values
    (these fields' defaults) for a checkpoint without one."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    """An image smaller than this (after rounding to the grid) is scaled up to it (HF ``size.shortest_edge``)."""
    max_pixels: int = 16777216
    """An image larger than this is scaled down to it (HF ``size.longest_edge``)."""
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3
    """Pillow's resampling filter (3: bicubic)."""
    max_input_pixels: int = 1 << 28
    """Larger input images are refused before they are decoded (a limit on memory, not on quality)."""

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "max_input_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ImageProcessor.{name}: expected a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"ImageProcessor.min_pixels: expected at most max_pixels={self.max_pixels}, "
                             f"got {self.min_pixels}")
        self.image_mean, self.image_std = tuple(self.image_mean), tuple(self.image_std)

    @classmethod
    def for_model(cls, folder: str | Path | None, vision: VisionConfig, **overrides: Any) -> ImageProcessor:
        """From ``folder/preprocessor_config.json`` when there is one; the patch sizes default to the
        vision tower's. ``overrides`` replace fields (e.g. ``max_input_pixels``). As in
        transformers, ``min_pixels`` / ``max_pixels`` win over ``size``'s edges."""
        fields: dict[str, Any] = dict(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                      merge_size=vision.spatial_merge_size)
        path = None if folder is None else Path(folder) / "preprocessor_config.json"
        if path is not None and path.is_file():
            hf = json.loads(path.read_text())
            size = hf.get("size") or {}
            fields.update(HF_DEFAULTS)
            for ours, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                value = hf[ours] if hf.get(ours) is not None else size.get(edge)
                if value is not None:
                    fields[ours] = value
            for key in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                        "rescale_factor", "do_resize", "do_rescale", "do_normalize", "resample"):
                if hf.get(key) is not None:
                    fields[key] = hf[key]
        fields.update(overrides)
        processor = cls(**fields)
        sizes = (processor.patch_size, processor.temporal_patch_size, processor.merge_size)
        if sizes != (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size):
            raise ValueError(f"{path}: patch_size, temporal_patch_size, merge_size {sizes} differ from the vision "
                             f"tower's {(vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)}")
        return processor

    def __call__(self, images: Sequence[ImageSource]) -> ImageInputs:
        """The images of one prompt, in order. ValueError naming the image for one that cannot be
        read or is too large."""
        patches, grids = [], []
        for i, source in enumerate(images):
            try:
                pixels, grid = self.patchify(self.pixels(load_image(source, self.max_input_pixels)))
            except ValueError as err:
                raise ImageError(f"image {i}: {err}", index=i) from None
            patches.append(pixels)
            grids.append(grid)
        if not patches:
            return ImageInputs(pixel_values=torch.empty((0, self.patch_features)),
                               image_grid_thw=torch.empty((0, 3), dtype=torch.int64))
        return ImageInputs(pixel_values=torch.from_numpy(np.concatenate(patches)),
                           image_grid_thw=torch.tensor(grids, dtype=torch.int64))

    @property
    def patch_features(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2

    def pixels(self, image) -> np.ndarray:
        """``[3, H', W']`` float32: the RGB PIL ``image`` resized, rescaled and normalised."""
        if self.do_resize:
            h, w = smart_resize(image.height, image.width, self.patch_size * self.merge_size, self.min_pixels,
                                self.max_pixels)
            image = image.resize((w, h), resample=self.resample)
        x = np.moveaxis(np.asarray(image), -1, 0)
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            x = x.astype(np.float32) if not np.issubdtype(x.dtype, np.floating) else x
            mean, std = np.array(self.image_mean, dtype=x.dtype), np.array(self.image_std, dtype=x.dtype)
            x = ((x.T - mean) / std).T
        return np.asarray(x, dtype=np.float32)

    def patchify(self, x: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """``([patches, 3 * Tp * P * P], (1, gh, gw))``: patches in merge-block order, each one
        repeated over the temporal patch."""
        c, height, width = x.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        if height % (p * m) or width % (p * m):
            raise ValueError(f"the image is {width}x{height} pixels, not a multiple of patch_size * merge_size = "
                             f"{p * m} (resizing is off)")
        gh, gw = height // p, width // p
        blocks = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], tp, p, p))
        return blocks.reshape(gh * gw, c * tp * p * p), (1, gh, gw)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size an image is resized to: both sides multiples of ``factor``, the area within
    ``[min_pixels, max_pixels]``, the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image is {width}x{height} pixels: its aspect ratio "
                         f"{max(height, width) / min(height, width):.0f} is above 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def load_image(source: ImageSource, max_pixels: int = 1 << 28):
    """An RGB PIL image from a path, an image file's bytes (PNG, JPEG, ... as Pillow reads them), a
    PIL image, or a uint8 ``[H, W, 3]`` tensor or array; ValueError saying what is wrong with it."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, (str, Path, bytes, bytearray)):
        if isinstance(source, (bytes, bytearray)):
            opens, unreadable = io.BytesIO(source), f"the {len(source)} bytes given hold no readable image"
        else:
            opens, unreadable = str(source), f"{str(source)!r} is not a readable image"
            if not Path(source).is_file():
                raise ValueError(f"no image file at {opens!r}")
        try:
            with Image.open(opens) as opened:
                _check_size(opened.width, opened.height, max_pixels)
                opened.load()
                image = opened.copy()
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as err:
            raise ValueError(f"{unreadable}: {err}") from None
    elif isinstance(source, Image.Image):
        image = source
    elif isinstance(source, (torch.Tensor, np.ndarray)):
        array = source.cpu().numpy() if isinstance(source, torch.Tensor) else source
        if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
            raise ValueError(f"an image array must be uint8 [H, W, 3], got {array.dtype} {list(array.shape)}")
        image = Image.fromarray(np.ascontiguousarray(array), mode="RGB")
    else:
        raise ValueError(f"an image must be a path, an image file's bytes, a PIL image or a uint8 [H, W, 3] tensor, got "
                         f"{type(source).__name__}")
    _check_size(image.width, image.height, max_pixels)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width < 1 or height < 1:
        raise ValueError(f"the image is empty ({width}x{height} pixels)")
    if width * height > max_pixels:
        raise ValueError(f"the image is {width}x{height} = {width * height} pixels, above the limit of "
                         f"{max_pixels} (max_input_pixels)")


def prepare_prompt_images(images: Sequence[Any] | None, processor: ImageProcessor | None
                          ) -> tuple[list[ImageInputs | None], dict[int, str]]:
    """Each prompt's :class:`ImageInputs` (None for none) from ``images`` (see
    :meth:`stagewise.api.Pipeline.generate`), and the error of each prompt whose images cannot be used."""
    prepared: list[ImageInputs | None] = []
    failed: dict[int, str] = {}
    for i, item in enumerate(images or []):
        try:
            prepared.append(_prompt_images(item, processor))
        except ValueError as err:
            prepared.append(None)
            failed[i] = f"prompt {i}: {err}"
    return prepared, failed


def _prompt_images(item: Any, processor: ImageProcessor | None) -> ImageInputs | None:
    if item is None:
        return None
    if isinstance(item, dict):
        missing = {"pixel_values", "image_grid_thw"} - set(item)
        if missing:
            raise ValueError(f"precomputed images need pixel_values and image_grid_thw; missing {sorted(missing)}")
        item = ImageInputs(pixel_values=item["pixel_values"], image_grid_thw=item["image_grid_thw"])
    if processor is None:
        raise ValueError("images were given but the model is text-only (it has no vision tower)")
    if isinstance(item, ImageInputs):
        return item
    sources = list(item) if isinstance(item, (list, tuple)) else [item]
    return processor(sources) if sources else None


def expand_prompts(encoded: list[list[int]], prepared: list[ImageInputs | None], vision: VisionConfig | None,
                   failed: dict[int, str]) -> dict[int, str]:
    """In place: each prompt with images gets one placeholder token per image token
    (:func:`stagewise.frontend.prompts.expand_image_placeholders`). Returns the prompts that could not be."""
    from stagewise.frontend.prompts import expand_image_placeholders

    errors = {}
    for i, inputs in enumerate(prepared):
        if inputs is None or i in failed or vision is None:
            continue
        merge = vision.spatial_merge_size
        counts = [t * h * w // (merge * merge) for t, h, w in inputs.image_grid_thw.tolist()]
        try:
            encoded[i] = expand_image_placeholders(encoded[i], counts, image_token_id=vision.image_token_id,
                                                   vision_start_id=vision.vision_start_token_id,
                                                   vision_end_id=vision.vision_end_token_id)
        except ValueError as err:
            errors[i] = f"prompt {i}: {err}"
    return errors

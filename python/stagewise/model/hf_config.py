"""HF ``config.json`` -> :class:`~stagewise.model.config.ModelConfig`.

The keys every model has (sizes, positions, special tokens, dtype, rope, a vision tower) are read
here; the model type names its architecture (:mod:`stagewise.model.architectures`), whose entry
reads the keys only it has. Defaults for keys a file leaves out are the ones the matching
transformers config class uses (transformers 5 saves some of its checkpoints' configs without
them, and hub files often omit them), so that a checkpoint means the same model here and there:
each entry's ``hf_defaults`` and :data:`VISION_DEFAULTS`, held against the classes themselves by
the tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from stagewise.model import architectures
from stagewise.model.architectures.base import HFKeys
from stagewise.model.config import ModelConfig, VisionConfig

# transformers' Qwen3VLVisionConfig (and Qwen3VLMoeVisionConfig, the same) for left-out keys.
VISION_DEFAULTS: dict[str, Any] = dict(
    depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16, in_channels=3,
    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584, num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24])


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The dict in ``path`` (a config.json file, or a folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model config: no config.json at {str(path)!r}")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"model config: {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"model config: {str(path)!r} holds a {type(hf).__name__}, expected a JSON object")
    return hf


def parse_config_file(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of ``path``: a ``config.json`` file or a folder holding one."""
    return parse_hf_config(read_config_json(path))


def parse_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """Parse an HF config dict; ValueError names the field for anything unsupported or inconsistent."""
    model_type = hf.get("model_type")
    arch = architectures.for_model_type(model_type)
    fields: dict[str, Any] = {}
    if model_type in arch.multimodal:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"config.json: field 'text_config' must be an object for model_type {model_type!r}")
        fields["vision_config"] = _vision(hf)
        # The composite config owns embedding tying and may be the only place naming the dtype.
        hf = {**text, "model_type": model_type,
              "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
              "dtype": text.get("dtype") or text.get("torch_dtype") or hf.get("dtype") or hf.get("torch_dtype")}
    hf = {**arch.hf_defaults[model_type], **hf}
    keys = HFKeys(hf, model_type)
    fields.update(
        architecture=arch.name,
        vocab_size=keys.get("vocab_size"),
        hidden_size=keys.get("hidden_size"),
        num_layers=keys.get("num_hidden_layers"),
        num_heads=keys.get("num_attention_heads"),
        max_position_embeddings=keys.get("max_position_embeddings", 2048),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos(hf.get("eos_token_id")),
        dtype=_dtype(hf.get("dtype") or hf.get("torch_dtype")),
    )
    fields.update(arch.parse(keys))
    if "rope" not in fields:  # an architecture with several ropes (one per layer type) reads its own
        fields["rope"] = keys.rope()
    return ModelConfig(**fields)


_VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _vision(hf: dict[str, Any]) -> VisionConfig:
    """The vision tower of a Qwen3-VL config (``vision_config``) and its image tokens (top level)."""
    v = hf.get("vision_config")
    if not isinstance(v, dict):
        raise ValueError(f"config.json: field 'vision_config' must be an object for model_type {hf['model_type']!r}")
    fields = {k: default if v.get(k) is None else v[k] for k, default in VISION_DEFAULTS.items()}
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(fields.get(key), (list, tuple)):  # HF allows [n, n]: only square patches are used
            sizes = set(fields[key])
            if len(sizes) != 1:
                raise ValueError(f"config.json: vision_config.{key} must be one size, got {fields[key]!r}")
            fields[key] = sizes.pop()
    rope = v.get("rope_parameters") or {}
    fields["rope_theta"] = float(rope.get("rope_theta") or v.get("rope_theta") or 10000.0)
    fields.update({k: hf[k] for k in _VISION_TOKENS if hf.get(k) is not None})
    try:
        return VisionConfig(**fields)
    except TypeError as err:
        raise ValueError(f"config.json: vision_config: {err}") from None


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"config.json: field 'eos_token_id' must be an integer or a list of integers, got {value!r}")
    return tuple(ids)


def _dtype(name: Any) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"config.json: field 'torch_dtype' must name a floating torch dtype, got {name!r}")
    return dtype

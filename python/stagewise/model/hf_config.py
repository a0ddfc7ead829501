"""HF ``config.json`` -> :class:`~stagewise.model.config.ModelConfig`.

Defaults for keys a file leaves out are the ones the matching transformers
config class uses (transformers 5 saves some of its checkpoints' configs without
them, and hub files often omit them), so that a checkpoint means the same model
here and there: :data:`TEXT_DEFAULTS` and :data:`VISION_DEFAULTS`, held against
the classes themselves by the tests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from stagewise.model.config import ModelConfig, RopeConfig, VisionConfig

# HF model_type -> stagewise architecture (Mistral is Llama with an optional sliding window).
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "falcon": "falcon"}
# Qwen3-VL checkpoints: the language model lives under text_config.
MULTIMODAL_TYPES = {"qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}
_MISSING = object()
# Per model_type, what transformers' config class gives a left-out key where the parser's
# general fallback (head_dim = hidden / heads, 2048 positions, theta 10000, no special tokens)
# would say otherwise. Qwen3-VL reads rope_theta and mrope_section inside rope_parameters.
MROPE_SECTION = (24, 20, 20)  # transformers' Qwen3-VL rotary embedding when the file names none
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    "mistral": dict(max_position_embeddings=131072, sliding_window=4096, bos_token_id=1, eos_token_id=2),
    "qwen3": dict(max_position_embeddings=32768, head_dim=128),
    "qwen3_moe": dict(max_position_embeddings=32768),
    "falcon": dict(max_position_embeddings=2048, bos_token_id=11, eos_token_id=11),
    "qwen3_vl": dict(max_position_embeddings=128000, head_dim=128, rope_theta=500000.0, mrope_section=MROPE_SECTION),
    "qwen3_vl_moe": dict(max_position_embeddings=128000, rope_theta=500000.0, mrope_section=MROPE_SECTION),
}
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


def _get(d: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    value = d.get(key)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"config.json: field {key!r} is required (model_type {d.get('model_type')!r})")
        return default
    return value


def parse_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """Parse an HF config dict; ValueError names the field for anything unsupported or inconsistent."""
    model_type = hf.get("model_type")
    fields: dict[str, Any] = {}
    if model_type in MULTIMODAL_TYPES:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"config.json: field 'text_config' must be an object for model_type {model_type!r}")
        fields["vision_config"] = _vision(hf)
        # The composite config owns embedding tying and may be the only place naming the dtype.
        text = {**text, "model_type": model_type,
                "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
                "dtype": text.get("dtype") or text.get("torch_dtype") or hf.get("dtype") or hf.get("torch_dtype")}
        architecture, hf = MULTIMODAL_TYPES[model_type], text
    elif model_type in MODEL_TYPES:
        architecture = MODEL_TYPES[model_type]
    else:
        supported = sorted([*MODEL_TYPES, *MULTIMODAL_TYPES])
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; expected one of {supported}")
    hf = {**TEXT_DEFAULTS[model_type], **hf}

    heads, hidden = _get(hf, "num_attention_heads"), _get(hf, "hidden_size")
    fields.update(
        architecture=architecture,
        vocab_size=_get(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=_get(hf, "num_hidden_layers"),
        num_heads=heads,
        max_position_embeddings=_get(hf, "max_position_embeddings", 2048),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos(hf.get("eos_token_id")),
        dtype=_dtype(hf.get("dtype") or hf.get("torch_dtype")),
    )
    if architecture == "falcon":
        fields.update(_falcon(hf, heads, hidden))
    else:
        fields.update(_llama_like(hf, architecture, heads, hidden))
    if architecture == "qwen3_moe":
        fields.update(
            num_experts=_get(hf, "num_experts", hf.get("num_local_experts", 0)),
            num_experts_per_tok=_get(hf, "num_experts_per_tok"),
            moe_intermediate_size=_get(hf, "moe_intermediate_size"),
            # Qwen3-VL-MoE's router always renormalises its top-k weights: transformers' class
            # has no such field, and a file saved by it names none.
            norm_topk_prob=model_type == "qwen3_vl_moe" or bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=_get(hf, "decoder_sparse_step", 1),
            mlp_only_layers=tuple(_get(hf, "mlp_only_layers", ())),
        )
    fields["rope"] = _rope(hf, fields["max_position_embeddings"])
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


def _head_dim(hf: dict[str, Any], heads: int, hidden: int) -> int:
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"config.json: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                "and no head_dim is given"
            )
        head_dim = hidden // heads
    return head_dim


def _llama_like(hf: dict[str, Any], architecture: str, heads: int, hidden: int) -> dict[str, Any]:
    if architecture != "llama" and hf.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=True is not supported for Qwen3 models")
    return dict(
        num_kv_heads=_get(hf, "num_key_value_heads", heads),
        head_dim=_head_dim(hf, heads, hidden),
        intermediate_size=_get(hf, "intermediate_size"),
        norm="rms",
        norm_eps=_get(hf, "rms_norm_eps", 1e-6),
        activation=_get(hf, "hidden_act", "silu"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=architecture != "llama",
        sliding_window=hf.get("sliding_window") if architecture == "llama" else None,
    )


def _falcon(hf: dict[str, Any], heads: int, hidden: int) -> dict[str, Any]:
    if hf.get("alibi"):
        raise ValueError("config.json: alibi=True (Falcon with ALiBi position bias) is not supported; "
                         "only rotary Falcon models are")
    new_arch = bool(hf.get("new_decoder_architecture", False))
    multi_query = bool(hf.get("multi_query", True)) and not new_arch
    if hidden % heads:
        raise ValueError(f"config.json: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
    if new_arch:
        kv_heads = _get(hf, "num_kv_heads", heads)  # Falcon-40B/180B: grouped KV heads
    elif multi_query:
        kv_heads = 1  # Falcon-7B: one KV head shared by all query heads
    else:
        kv_heads = heads  # RW-1B: fused qkv of num_heads each
    # The new layout always runs attention and MLP in parallel, by default with two input norms.
    parallel = new_arch or bool(hf.get("parallel_attn", True))
    bias = bool(hf.get("bias", False))
    return dict(
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=_get(hf, "ffn_hidden_size", 4 * hidden),
        norm="layer",
        norm_eps=_get(hf, "layer_norm_epsilon", 1e-5),
        activation=_get(hf, "activation", "gelu"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=bias,
        mlp_bias=bias,
        new_decoder_architecture=new_arch,
        multi_query=multi_query,
        parallel_attn=parallel,
        num_ln_in_parallel_attn=_get(hf, "num_ln_in_parallel_attn", 2 if new_arch else 1) if parallel else 1,
    )


def _rope(hf: dict[str, Any], max_position: int) -> RopeConfig:
    """Classic (rope_theta + rope_scaling) and transformers 5 (rope_parameters) forms."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"config.json: field 'rope_parameters' must be one flat object, got {params!r}")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    kw: dict[str, Any] = dict(
        type=rope_type,
        theta=float(_first(params.get("rope_theta"), hf.get("rope_theta"), 10000.0)),
        partial_rotary_factor=float(_first(params.get("partial_rotary_factor"), hf.get("partial_rotary_factor"), 1.0)),
        mrope_section=params.get("mrope_section") or hf.get("mrope_section"),
        mrope_interleaved=bool(params.get("mrope_interleaved", False)),
    )
    if rope_type in ("llama3", "yarn"):
        # As transformers: a top-level original_max_position_embeddings wins (Phi-3 style files).
        original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        kw["original_max_position_embeddings"] = original or max_position
    if rope_type in ("linear", "llama3"):
        kw["factor"] = float(_get(params, "factor"))
    if rope_type == "llama3":
        kw.update(low_freq_factor=float(_get(params, "low_freq_factor")),
                  high_freq_factor=float(_get(params, "high_freq_factor")))
    if rope_type == "yarn":
        factor = params.get("factor") or max_position / kw["original_max_position_embeddings"]
        kw.update(factor=float(factor),
                  beta_fast=float(params.get("beta_fast") or 32.0),
                  beta_slow=float(params.get("beta_slow") or 1.0),
                  truncate=bool(params.get("truncate", True)),
                  attention_factor=_yarn_attention_factor(params, factor))
    return RopeConfig(**kw)


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """YaRN's cos/sin scale (mscale): given, or 0.1 * ln(factor) + 1 (DeepSeek's ratio form when set)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


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

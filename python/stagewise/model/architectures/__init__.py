"""The registry of architectures: one file each, and its entry here (its module imported, its line in
:data:`ARCHITECTURES`).

An architecture is the :class:`~stagewise.model.architectures.base.Architecture` entry its file
defines (its HF config keys, its rows of the tensor table, its GGUF names, its layer's wiring, what
the planner times of a layer, and whether the C++ layer loop takes its layers). Everything else
finds it here: by ``ModelConfig.architecture`` (:func:`of`, :func:`get`), by an HF ``model_type``
(:func:`for_model_type`) or by a GGUF file's ``general.architecture`` (:func:`for_gguf`).
"""

from __future__ import annotations

from stagewise.model.architectures import falcon, gemma3, llama, qwen2, qwen3, qwen3_moe
from stagewise.model.architectures.base import Architecture, own_fields
from stagewise.model.config import ModelConfig

ARCHITECTURES: tuple[Architecture, ...] = (
    llama.ARCHITECTURE,
    qwen2.ARCHITECTURE,
    qwen3.ARCHITECTURE,
    qwen3_moe.ARCHITECTURE,
    falcon.ARCHITECTURE,
    gemma3.ARCHITECTURE,
)


def _index(pairs: list[tuple[str, Architecture]], what: str) -> dict[str, Architecture]:
    out: dict[str, Architecture] = {}
    for key, entry in pairs:
        if key in out:
            raise ValueError(f"architectures: {what} {key!r} is claimed by both {out[key].name!r} and {entry.name!r}")
        out[key] = entry
    return out


BY_NAME = _index([(a.name, a) for a in ARCHITECTURES], "name")
MODEL_TYPES = _index([(t, a) for a in ARCHITECTURES for t in a.hf_defaults], "HF model_type")
"""HF model_type -> its entry (Mistral's is Llama's, Qwen3-VL's Qwen3's)."""
GGUF_ARCHITECTURES = _index([(g, a) for a in ARCHITECTURES if a.gguf for g in a.gguf.architectures],
                            "GGUF architecture")


def get(name: str) -> Architecture:
    """The entry named ``name`` (a ``ModelConfig.architecture``)."""
    if name not in BY_NAME:
        raise ValueError(f"ModelConfig.architecture: expected one of {sorted(BY_NAME)}, got {name!r}")
    return BY_NAME[name]


def of(config: ModelConfig) -> Architecture:
    """The entry of ``config``, whose ``arch`` must be the entry's own fields."""
    entry = get(config.architecture)
    own_fields(config, entry.own_fields)
    return entry


def for_model_type(model_type: object) -> Architecture:
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; expected one of "
                         f"{sorted(MODEL_TYPES)}")
    return MODEL_TYPES[model_type]


def for_gguf(name: object) -> Architecture:
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(f"gguf: general.architecture {name!r} is not supported; expected one of "
                         f"{sorted(GGUF_ARCHITECTURES)}")
    return GGUF_ARCHITECTURES[name]


def layer_windows(config: ModelConfig, layers: range | None = None) -> list[int | None]:
    """The attention window of each layer (of ``layers``, default every one): the keys its queries
    see at most, or None for full attention (also a window that reaches every position). What the
    attention layer applies, the KV cache trims to, the C++ layer loop cannot run and the planner
    prices (from each layer's :class:`~stagewise.model.architectures.base.LayerWork`)."""
    entry = of(config)
    out: list[int | None] = []
    for i in range(config.num_layers) if layers is None else layers:
        w = entry.layer_work(config, i).window
        out.append(w if w is not None and w < config.max_position_embeddings else None)
    return out


def windowed_layers(config: ModelConfig, layers: range | None = None) -> list[int]:
    """The layers (of ``layers``, default every one) that attend over a sliding window (see
    :func:`layer_windows`)."""
    layers = range(config.num_layers) if layers is None else layers
    return [i for i, w in zip(layers, layer_windows(config, layers)) if w is not None]

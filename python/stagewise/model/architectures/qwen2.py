"""Qwen2 (and Qwen2.5): Llama with biases on q, k and v (not on o, nor in the MLP).

transformers' Qwen2 has no ``attention_bias`` key: its q/k/v projections always carry biases.
Its config holds sliding-window keys that published checkpoints leave off
(``use_sliding_window: false``); with them on, the layers from ``max_window_layers`` on (or those
``layer_types`` marks) attend over a window, which is refused here by name. llama.cpp stores it as
``qwen2``, with Llama's tensor names and the Q/K rows as HF keeps them.
"""

from __future__ import annotations

from typing import Any

from stagewise.model.architectures import llama
from stagewise.model.architectures.base import Architecture, GGUFNames, HFKeys


def _windowed_layers(hf: HFKeys) -> list[int]:
    """The layers transformers' Qwen2 runs with a sliding window (its config class's rule)."""
    if not hf.get("use_sliding_window", False) or hf.get("sliding_window", None) is None:
        return []
    types = hf.get("layer_types", None)
    if types is None:
        first = hf.get("max_window_layers", 28)
        return list(range(first, hf.get("num_hidden_layers")))
    return [i for i, kind in enumerate(types) if kind == "sliding_attention"]


def _parse(hf: HFKeys) -> dict[str, Any]:
    windowed = _windowed_layers(hf)
    if windowed:
        raise ValueError(f"config.json: use_sliding_window=True gives layers {windowed} of this {hf.model_type} model "
                         f"a sliding_window={hf.get('sliding_window')} (max_window_layers="
                         f"{hf.get('max_window_layers', 28)}); only full attention is supported")
    return llama.fields(hf, qkv_bias=True, o_bias=False)


ARCHITECTURE = Architecture(
    name="qwen2",
    hf_defaults={"qwen2": dict(max_position_embeddings=32768)},
    parse=_parse,
    layer_tensors=llama.layer_tensors, final_norm_tensors=llama.final_norm_tensors,
    build_layer=llama.build_layer, build_final_norm=llama.build_final_norm,
    layer_work=llama.gated_work,
    decode_stack=None,
    gguf=GGUFNames(architectures=("qwen2",), model_type="qwen2", layer_tensors=llama.GGUF_LAYER_NAMES),
)

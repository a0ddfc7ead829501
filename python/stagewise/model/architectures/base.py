"""What an architecture is to the rest of stagewise: :class:`Architecture`, the entry each file of
this package defines and the registry (:mod:`stagewise.model.architectures`) lists.

An entry holds everything that differs from one architecture to the next, so that nothing outside
its file asks which architecture a model is:

- HF ``config.json``: the model types it reads, with the defaults transformers' config class of
  each fills in for keys a file leaves out, and ``parse``, which turns the keys only it reads into
  :class:`~stagewise.model.config.ModelConfig` fields (:mod:`stagewise.model.hf_config` parses the
  keys every model has, rope and the vision tower);
- tensors: the names of its embedding, final norm and layers, and its layer's rows of the table
  (:mod:`stagewise.model.shapes`, which the loader and the planner read), with their
  tensor-parallel splits;
- GGUF: the llama.cpp names of its tensors and how its converter stored them (:class:`GGUFNames`);
- wiring: its decoder layer and final norm, built from the table's names;
- the planner: what one decoder layer computes (:class:`LayerWork`);
- the C++ layer loop (:mod:`stagewise.model.decode_stack`): whether it takes the architecture's
  layers, or why not (``decode_stack``: a reason, stated, rather than a silent fallback).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stagewise.model.collectives import StageGroups
from stagewise.model.config import ModelConfig, RopeConfig
from stagewise.model.layers.rotary import Rotary
from stagewise.model.rows import TensorShape
from stagewise.model.weights import Weights

REQUIRED = object()
"""``HFKeys.get``'s default for a key the file must give."""
MLPS = ("gated", "plain", "experts")


class HFKeys:
    """An HF text config dict, its model type's defaults filled in, as an architecture reads it."""

    def __init__(self, keys: Mapping[str, Any], model_type: str) -> None:
        self.keys, self.model_type = keys, model_type

    def get(self, key: str, default: Any = REQUIRED) -> Any:
        """The key's value; ``default`` where it is left out or null (ValueError naming it when required)."""
        value = self.keys.get(key)
        if value is None:
            if default is REQUIRED:
                raise ValueError(f"config.json: field {key!r} is required (model_type {self.model_type!r})")
            return default
        return value

    def head_dim(self) -> int:
        """``head_dim``, or ``hidden_size / num_attention_heads`` when left out (it must divide then)."""
        heads, hidden = self.get("num_attention_heads"), self.get("hidden_size")
        head_dim = self.keys.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"config.json: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                                 "and no head_dim is given")
            head_dim = hidden // heads
        return head_dim

    def rope(self, params: Mapping[str, Any] | None = None) -> RopeConfig:
        """The rope of these keys, in the classic (rope_theta + rope_scaling) and transformers 5
        (rope_parameters) forms; ``params``: one set of a file that has several (one per layer type)."""
        hf, max_position = self.keys, self.get("max_position_embeddings", 2048)
        params = (hf.get("rope_parameters") or hf.get("rope_scaling") or {}) if params is None else params
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"config.json: field 'rope_parameters' must be one flat object, got {params!r}")
        rope_type = params.get("rope_type") or params.get("type") or "default"
        given = HFKeys(params, self.model_type)
        kw: dict[str, Any] = dict(
            type=rope_type,
            theta=float(first(params.get("rope_theta"), hf.get("rope_theta"), 10000.0)),
            partial_rotary_factor=float(first(params.get("partial_rotary_factor"), hf.get("partial_rotary_factor"),
                                              1.0)),
            mrope_section=params.get("mrope_section") or hf.get("mrope_section"),
            mrope_interleaved=bool(params.get("mrope_interleaved", False)),
        )
        if rope_type in ("llama3", "yarn"):
            # As transformers: a top-level original_max_position_embeddings wins (Phi-3 style files).
            original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
            kw["original_max_position_embeddings"] = original or max_position
        if rope_type in ("linear", "llama3"):
            kw["factor"] = float(given.get("factor"))
        if rope_type == "llama3":
            kw.update(low_freq_factor=float(given.get("low_freq_factor")),
                      high_freq_factor=float(given.get("high_freq_factor")))
        if rope_type == "yarn":
            factor = params.get("factor") or max_position / kw["original_max_position_embeddings"]
            kw.update(factor=float(factor),
                      beta_fast=float(params.get("beta_fast") or 32.0),
                      beta_slow=float(params.get("beta_slow") or 1.0),
                      truncate=bool(params.get("truncate", True)),
                      attention_factor=_yarn_attention_factor(params, factor))
        return RopeConfig(**kw)


def first(*values: Any) -> Any:
    """The first of ``values`` that is not None."""
    return next(v for v in values if v is not None)


def _yarn_attention_factor(params: Mapping[str, Any], factor: float) -> float:
    """YaRN's cos/sin scale (mscale): given, or 0.1 * ln(factor) + 1 (DeepSeek's ratio form when set)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


@dataclass(slots=True)
class StageBuild:
    """What a stage hands its architecture's layer builder besides the config and the weights."""

    groups: StageGroups
    """The stage's rank groups: a layer reduces its partial sums over ``groups.tp``."""
    rotary: Rotary
    """The rope table of ``config.rope``, one for all the stage's layers."""
    dtype: torch.dtype
    device: torch.device
    shared: dict[str, Any] = field(default_factory=dict)
    """What else the stage's layers share (another rope table, for layers of another rope base):
    see :meth:`share`."""

    def share(self, key: str, make: Callable[[], Any]) -> Any:
        """The stage's one ``key``, made by ``make`` for the first layer that asks."""
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]


@dataclass(frozen=True, slots=True)
class LayerWork:
    """What the planner times of one decoder layer, beyond its attention (from the config)."""

    mlp: str
    """gated (gate and up, an activation, down), plain (up, an activation, down) or experts."""
    window: int | None = None
    """Keys a query attends to at most (sliding window); None: every one before it."""
    post_norms: bool = False
    """The outputs of attention and of the MLP are normed too (Gemma's four norms a layer)."""

    def __post_init__(self) -> None:
        if self.mlp not in MLPS:
            raise ValueError(f"LayerWork.mlp: expected one of {MLPS}, got {self.mlp!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class GGUFNames:
    """How llama.cpp's converter writes an architecture to GGUF."""

    architectures: tuple[str, ...]
    """Values of ``general.architecture`` this entry reads (llama.cpp's names)."""
    model_type: str
    """The HF model type the file's config is parsed as (one of the entry's ``hf_defaults``)."""
    layer_tensors: Mapping[str, str]
    """llama.cpp's name inside a block (``attn_q.weight``) -> the HF name inside a layer
    (``self_attn.q_proj.weight``); the embedding, final norm and LM head map by the entry's names."""
    permuted_qk: bool = False
    """The converter permuted the rows of attn_q / attn_k (weights and biases) for its
    adjacent-pair rope (llama); the loader restores HF's order."""
    metadata: Mapping[str, str] = field(default_factory=dict)
    """More llama.cpp metadata keys (after ``{architecture}.``) -> the HF config keys they fill
    (``attention.sliding_window`` -> ``sliding_window``), beside the ones every file has."""
    adjust: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    """``(HF name, values read)`` -> the values HF holds, for tensors the converter changed (Gemma's
    norms, stored with 1 added). Applied to values read dense (norms always are); a matrix kept in
    its GGUF blocks is taken as stored."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Architecture:
    """One registry entry (see the module docstring)."""

    name: str
    """``ModelConfig.architecture``."""
    hf_defaults: Mapping[str, Mapping[str, Any]]
    """HF model_type -> what its transformers config class fills in for keys a file leaves out,
    where that differs from the general fallback (head_dim = hidden / heads, 2048 positions,
    rope theta 10000, no special tokens)."""
    parse: Callable[[HFKeys], dict[str, Any]]
    """The ModelConfig fields of the keys only this architecture reads: ``num_kv_heads``,
    ``head_dim``, ``intermediate_size``, ``norm_eps``, ``activation``, ``tie_word_embeddings``,
    the biases, ``qk_norm``, ``sliding_window``, ``moe`` and ``arch``, as it has them; and ``rope``
    when it reads its own (a file with one rope per layer type), else the parser reads it
    (:meth:`HFKeys.rope`)."""
    multimodal: frozenset[str] = frozenset()
    """Model types whose text model sits under ``text_config`` beside a vision tower (Qwen3-VL)."""
    own_fields: type | None = None
    """The type of ``ModelConfig.arch`` for this architecture (None: it has no fields of its own)."""
    prefix: str = "model."
    """Name prefix of the text model's tensors."""
    multimodal_prefix: str | None = None
    """The prefix in a multimodal checkpoint (``model.language_model.``)."""
    layers: str = "layers"
    """Decoder layer ``i``'s names start with ``{prefix}{layers}.{i}.``."""
    embedding: str = "embed_tokens.weight"
    final_norm: str = "norm"
    """The final norm's tensors are ``{prefix}{final_norm}.weight`` (and ``.bias``)."""
    layer_tensors: Callable[[ModelConfig, int, str], list[TensorShape]]
    """``(config, layer, prefix)``: the table's rows of decoder layer ``layer``, named under ``prefix``."""
    final_norm_tensors: Callable[[ModelConfig, str], list[TensorShape]]
    """``(config, name)``: the final norm's rows (part ``final_norm``), ``{name}.weight`` ..."""
    build_layer: Callable[[ModelConfig, int, str, Weights, StageBuild], nn.Module]
    """``(config, layer, prefix, weights, stage)``: decoder layer ``layer`` of a TP rank, from its
    weights (already cut for the rank) named under ``prefix``; it returns ``(x, residual)`` from
    ``(x, residual, batch, meta, kv)``."""
    build_final_norm: Callable[[ModelConfig, str, Weights], nn.Module]
    """``(config, name, weights)``: the final norm (its tensors ``{name}.weight`` ...), with the
    interface of :class:`~stagewise.model.layers.norm.RMSNorm`."""
    embedding_scale: Callable[[ModelConfig], float] | None = None
    """What multiplies the embedding's vectors (in the compute dtype, as transformers rounds it);
    None: nothing does."""
    layer_work: Callable[[ModelConfig, int], LayerWork]
    """``(config, layer)``: what the planner times of decoder layer ``layer``."""
    decode_stack: str | None
    """None when the C++ layer loop takes this architecture's layers (then every layer must be one
    it runs: :func:`~stagewise.model.decode_stack.build_decode_stack` refuses others); else why it
    does not, which a stage reports (``StageModel.python_loop_reason``) and the planner counts."""
    gguf: GGUFNames | None = None
    """How it is stored in GGUF files (None: not read from them)."""
    fused_qkv_heads: Callable[[ModelConfig], list[tuple[str, int]]] | None = None
    """For a ``fused_qkv`` tensor: its ``head_dim``-row blocks in order, each ``("q", h)``,
    ``("k", h)`` or ``("v", h)`` (query head or KV head ``h``): what a TP rank's cut takes."""

    def text_prefix(self, multimodal: bool = False) -> str:
        """The text model's name prefix, in a multimodal checkpoint when ``multimodal``."""
        if not multimodal:
            return self.prefix
        if self.multimodal_prefix is None:
            raise ValueError(f"ModelConfig.vision_config: architecture {self.name!r} has no multimodal checkpoint "
                             "layout; expected None")
        return self.multimodal_prefix

    def layer_prefix(self, layer: int, multimodal: bool = False) -> str:
        """Name prefix of decoder layer ``layer``'s tensors (``model.layers.3.``, ``transformer.h.3.`` ...)."""
        return f"{self.text_prefix(multimodal)}{self.layers}.{layer}."


def own_fields(config: ModelConfig, cls: type) -> Any:
    """``config.arch``, which must be a ``cls`` (None when ``cls`` is)."""
    if cls is None:
        if config.arch is not None:
            raise ValueError(f"ModelConfig.arch: architecture {config.architecture!r} has no fields of its own; "
                             f"expected None, got {config.arch!r}")
        return None
    if not isinstance(config.arch, cls):
        raise ValueError(f"ModelConfig.arch: expected a {cls.__name__} for architecture {config.architecture!r}, "
                         f"got {config.arch!r}")
    return config.arch

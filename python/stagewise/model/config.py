"""The model description shared by the runtime and the planner.

:class:`ModelConfig` says what every decoder-only LM here has and what the shared layers, the
loader and the planner read: sizes, biases, rope (:class:`RopeConfig`), special tokens, and, for
the models that have them, experts (:class:`MoEConfig`) and a vision tower (:class:`VisionConfig`).
What only one architecture reads lives in that architecture's own frozen dataclass,
``ModelConfig.arch`` (Falcon's qkv layout, for one), defined in its file of
:mod:`stagewise.model.architectures`. Everything validates itself; the parsing of HF
``config.json`` files lives in :mod:`stagewise.model.hf_config`, which builds on this module
(never the other way round).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _fail(owner: str, name: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"{owner}.{name}: expected {expected}, got {value!r}")


def _positive(owner: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise _fail(owner, name, value, "a positive integer")


@dataclass(kw_only=True, slots=True)
class RopeConfig:
    """Rotary position embedding, with the parameters of each scaling type."""

    theta: float = 10000.0
    """Base of the inverse frequencies ``theta ** (-2i / rotary_dim)``."""
    type: str = "default"
    """Scaling of the frequencies: default (none), linear, llama3 or yarn."""
    factor: float = 1.0
    """Context extension factor (linear, llama3, yarn)."""
    original_max_position_embeddings: int | None = None
    """Pretraining context length (llama3, yarn)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max / high_freq_factor are kept."""
    beta_fast: float = 32.0
    """yarn: rotations that bound the extrapolated (unscaled) band."""
    beta_slow: float = 1.0
    """yarn: rotations that bound the interpolated (scaled) band."""
    truncate: bool = True
    """yarn: round the correction range outwards to whole dimensions."""
    attention_factor: float = 1.0
    """Multiplies cos and sin (yarn's mscale; 1 for the other types)."""
    partial_rotary_factor: float = 1.0
    """Fraction of head_dim that is rotated; the rest passes through."""
    is_neox: bool = True
    """Rotation pairs (i, i + d/2) as in NeoX/HF rotate_half; False pairs (2i, 2i+1)."""
    mrope_section: tuple[int, ...] | None = None
    """Qwen3-VL multimodal rope: frequency bands for the (t, h, w) position axes, interleaved as
    transformers reads them for any sizes (:func:`stagewise.model.layers.rotary.mrope_axes`); real
    checkpoints' bands sum to ``rotary_dim / 2``."""
    mrope_interleaved: bool = False
    """As the file says; Qwen3-VL interleaves the bands whatever it says, as transformers does."""

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise _fail("RopeConfig", "type", self.type, f"one of {ROPE_TYPES}")
        if not self.theta > 0:
            raise _fail("RopeConfig", "theta", self.theta, "a positive number")
        if not self.factor > 0:
            raise _fail("RopeConfig", "factor", self.factor, "a positive number")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise _fail("RopeConfig", "partial_rotary_factor", self.partial_rotary_factor, "a number in (0, 1]")
        if self.type in ("llama3", "yarn"):
            _positive("RopeConfig", self, "original_max_position_embeddings")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise _fail(
                "RopeConfig", "high_freq_factor", (self.low_freq_factor, self.high_freq_factor),
                "high_freq_factor > low_freq_factor > 0",
            )
        if self.mrope_section is not None:
            self.mrope_section = tuple(self.mrope_section)


@dataclass(kw_only=True, slots=True)
class VisionConfig:
    """The Qwen3-VL vision tower (HF ``vision_config``) and the special tokens of images in a prompt."""

    depth: int
    """Transformer blocks of the ViT."""
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    """Width of the merged image features: the text model's hidden size."""
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    """Each merged image token covers ``spatial_merge_size ** 2`` patches."""
    num_position_embeddings: int = 2304
    """Learned positions: a square grid, interpolated to each image's grid."""
    deepstack_visual_indexes: tuple[int, ...] = ()
    """ViT blocks whose output feeds a DeepStack merger; level k is added after decoder layer k."""
    rope_theta: float = 10000.0
    """Base of the ViT's 2-D rotary frequencies."""
    image_token_id: int = 151655
    """The placeholder token, one per merged patch of an image."""
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    def __post_init__(self) -> None:
        _positive("VisionConfig", self, "depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                  "in_channels", "patch_size", "temporal_patch_size", "spatial_merge_size",
                  "num_position_embeddings")
        self.deepstack_visual_indexes = tuple(self.deepstack_visual_indexes)
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise _fail("VisionConfig", "num_heads", self.num_heads,
                        f"a divisor of hidden_size={self.hidden_size} leaving a head_dim divisible by 4 (2-D rope)")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise _fail("VisionConfig", "num_position_embeddings", self.num_position_embeddings, "a square number")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise _fail("VisionConfig", "deepstack_visual_indexes", list(self.deepstack_visual_indexes),
                        f"block indices in [0, depth={self.depth})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_width(self) -> int:
        """Features of one merged token before the merger's MLP (``hidden * merge ** 2``)."""
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def patch_features(self) -> int:
        """Values of one flattened patch: ``in_channels * temporal_patch_size * patch_size ** 2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP (Qwen3-MoE's, Qwen3-VL-MoE's): which layers have one, and its
    experts."""

    num_experts: int
    num_experts_per_tok: int
    """Experts each token runs (top-k of the router)."""
    intermediate_size: int
    """Width of each expert's MLP (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool = False
    """Renormalise the top-k router probabilities to sum to one."""
    decoder_sparse_step: int = 1
    """Every decoder_sparse_step-th layer is sparse (see :meth:`ModelConfig.is_moe_layer`)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP whatever decoder_sparse_step says."""

    def __post_init__(self) -> None:
        _positive("MoEConfig", self, "num_experts", "num_experts_per_tok", "intermediate_size", "decoder_sparse_step")
        if self.num_experts_per_tok > self.num_experts:
            raise _fail("MoEConfig", "num_experts_per_tok", self.num_experts_per_tok,
                        f"at most num_experts={self.num_experts}")
        self.mlp_only_layers = tuple(self.mlp_only_layers)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """A decoder-only LM: embedding, ``num_layers`` decoder layers, final norm, LM head."""

    architecture: str
    """The registry's name of the code that runs it (:mod:`stagewise.model.architectures`)."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA; 1 for multi-query attention)."""
    head_dim: int
    intermediate_size: int
    """Width of the dense MLP."""
    norm_eps: float = 1e-6
    activation: str = "silu"
    """HF name of the MLP activation (gated or plain, as the architecture's MLP is)."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding matrix."""
    qkv_bias: bool = False
    """The q, k and v projections carry biases."""
    o_bias: bool = False
    """The attention's output projection carries a bias."""
    mlp_bias: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before rope (Qwen3)."""
    sliding_window: int | None = None
    """Attention window when the checkpoint asks for one (None: full attention)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    """Every token id that ends generation (HF eos_token_id may be a list)."""
    dtype: torch.dtype | None = None
    """dtype the config states for the weights; None when it states none."""
    moe: MoEConfig | None = None
    """The sparse MLP of a mixture-of-experts model; None for a dense one."""
    vision_config: VisionConfig | None = None
    """The vision tower and the image tokens of a Qwen3-VL model; None for a text-only model."""
    arch: Any = None
    """The architecture's own fields: a frozen dataclass of its file (Falcon's qkv layout, for one),
    None for an architecture that has none. Its registry entry checks the type
    (:func:`stagewise.model.architectures.of`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not self.architecture:
            raise _fail("ModelConfig", "architecture", self.architecture, "a registered architecture's name")
        _positive("ModelConfig", self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size", "max_position_embeddings")
        if not self.norm_eps > 0:
            raise _fail("ModelConfig", "norm_eps", self.norm_eps, "a positive number")
        if self.num_heads % self.num_kv_heads:
            raise _fail("ModelConfig", "num_kv_heads", self.num_kv_heads,
                        f"a divisor of num_heads={self.num_heads}")
        rotary_dim = self.rotary_dim
        if rotary_dim < 2 or rotary_dim % 2:
            raise _fail("ModelConfig", "rope.partial_rotary_factor", self.rope.partial_rotary_factor,
                        f"a factor giving an even rotary_dim >= 2 of head_dim={self.head_dim}, got {rotary_dim}")
        self.eos_token_ids = tuple(self.eos_token_ids)
        if self.moe is not None:
            bad = [i for i in self.moe.mlp_only_layers if not 0 <= i < self.num_layers]
            if bad:
                raise _fail("ModelConfig", "moe.mlp_only_layers", list(self.moe.mlp_only_layers),
                            f"layer indices in [0, {self.num_layers})")
        section = self.rope.mrope_section
        if section is not None and (len(section) != 3 or not all(isinstance(n, int) and n >= 0 for n in section)):
            raise _fail("ModelConfig", "rope.mrope_section", list(section), "3 band sizes (t, h, w), each >= 0")
        v = self.vision_config
        if v is not None and v.out_hidden_size != self.hidden_size:
            raise _fail("ModelConfig", "vision_config.out_hidden_size", v.out_hidden_size,
                        f"the text model's hidden_size={self.hidden_size}")

    @property
    def is_multimodal(self) -> bool:
        """Whether the model has a vision tower (Qwen3-VL)."""
        return self.vision_config is not None

    @property
    def rotary_dim(self) -> int:
        """Leading features of each head that rope rotates (HF: ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a sparse MoE block (Qwen3-MoE's rule: every
        ``decoder_sparse_step``-th layer but the ``mlp_only_layers``; none without ``moe``)."""
        if not 0 <= layer < self.num_layers:
            raise _fail("ModelConfig.is_moe_layer", "layer", layer, f"an index in [0, {self.num_layers})")
        moe = self.moe
        return moe is not None and layer not in moe.mlp_only_layers and (layer + 1) % moe.decoder_sparse_step == 0

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

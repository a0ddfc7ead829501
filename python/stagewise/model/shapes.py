"""The table of every weight tensor of a model, from its config alone: the one place that knows
each tensor's checkpoint name, shape, owner and tensor-parallel split. The loader reads what it
loads from here, the architectures take their tensor names from here and the planner counts
parameters, stage bytes and shard bytes from here.

Names and shapes are those of the transformers model built from the same config.json (``[out, in]``
linears, transformers 5's fused ``mlp.experts.gate_up_proj``, Falcon's fused ``query_key_value``,
the Qwen3-VL vision tower), so the totals equal its parameter count. Checkpoint files that store a
tensor in another form (one tensor per expert, a tied LM head left out) are mapped onto these
entries by :mod:`stagewise.model.loader`.

Ownership by pipeline stage: the first stage holds the embedding and the vision tower, every stage
its decoder layers, the last stage the final norm and the LM head. With tied embeddings a single
stage stores the matrix once; a pipeline's last stage holds its own copy.

Tensor-parallel splits (``TensorShape.split``; Megatron's layout over ``tp`` ranks, ``W [out, in]``):

- ``replicated``: every rank holds the whole tensor (norms, router, and the bias of a row-parallel
  linear, which is added once after the partial sums are reduced); the vision tower is whole too,
  held by TP rank 0 of the first stage only (it runs the tower for the stage), the rank the
  planner's largest per-rank bytes describe.
- ``column``: rank ``r`` holds rows ``[r * out / tp, (r + 1) * out / tp)`` (q, gate, up and their
  biases; whole query heads since ``tp`` divides the head count).
- ``row``: rank ``r`` holds the same block of columns of ``in`` (o, down): partial sums.
- ``kv_column``: k and v by whole KV heads, ``num_kv_heads / tp`` each; with more ranks than KV
  heads each head is held by ``tp / num_kv_heads`` consecutive ranks.
- ``fused_qkv``: Falcon's ``query_key_value``, by whole heads of its layout: each rank's rows keep
  the layout, with the rank's query heads and KV heads (KV heads shared as in ``kv_column``).
- ``vocab``: rows in blocks of ``ceil(vocab / tp)``, the last block padded with zero rows, so that
  every rank holds the same shape (embedding and LM head: vocab parallel).
- ``expert_column`` / ``expert_row``: per expert, its gate and up halves column-split, its down
  projection row-split, over ``moe_tp`` ranks; ``ep`` ranks hold ``num_experts / ep`` experts each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagewise.model.config import ModelConfig

PARTS = ("vision", "embedding", "layer", "final_norm", "lm_head")
SPLITS = ("replicated", "column", "row", "kv_column", "fused_qkv", "vocab", "expert_column", "expert_row")
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True, slots=True)
class TensorShape:
    """One weight tensor."""

    name: str
    """Its name in the HF checkpoint (and in the transformers model)."""
    shape: tuple[int, ...]
    part: str
    """vision, embedding, layer, final_norm or lm_head."""
    split: str = "replicated"
    """How tensor parallelism shards it (see the module docstring)."""
    layer: int | None = None
    kind: str = "linear"
    """linear (a matmul weight), bias, norm, expert (read only for the experts a token picks),
    router, embedding or conv (vision stem)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Sharding:
    """Parallel sizes of one rank: dense TP, expert parallel and MoE tensor parallel, and the
    context-parallel sizes (``dcp`` decode, ``pcp`` prefill), which shard the cached sequence, not
    the weights (:func:`rank_numel` ignores them)."""

    tp: int = 1
    ep: int = 1
    moe_tp: int = 1
    dcp: int = 1
    pcp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "moe_tp", "dcp", "pcp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Sharding.{name}: expected an int >= 1, got {value!r}")


def check_sharding(config: ModelConfig, sharding: Sharding) -> None:
    """ValueError when ``config`` cannot be split as ``sharding`` asks (heads, KV heads, experts).
    Widths split along with them (intermediate size, hidden size of the heads) are checked where a
    tensor is cut (:func:`stagewise.model.loader.sharding.rank_cut`), naming the tensor."""
    tp, hq, hk = sharding.tp, config.num_heads, config.num_kv_heads
    if hq % tp:
        raise ValueError(f"tensor parallel: tp={tp} must divide num_attention_heads={hq} (each rank runs whole "
                         f"query heads); valid tp sizes for this model: {valid_tp_sizes(config)}")
    if hk % tp and tp % hk:
        raise ValueError(f"tensor parallel: tp={tp} and num_key_value_heads={hk} must divide one another "
                         f"(KV heads are split, or replicated when TP exceeds them); valid tp sizes for this "
                         f"model: {valid_tp_sizes(config)}")
    if config.num_experts:
        if config.num_experts % sharding.ep:
            raise ValueError(f"expert parallel: ep={sharding.ep} must divide num_experts={config.num_experts}")
        if config.moe_intermediate_size % sharding.moe_tp:
            raise ValueError(f"expert parallel: moe_tp={sharding.moe_tp} must divide "
                             f"moe_intermediate_size={config.moe_intermediate_size}")


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """The tp sizes the model allows: divisors of the query heads that divide the KV heads or are a
    multiple of them, and divide the MLP's (and the experts') intermediate size."""
    hq, hk = config.num_heads, config.num_kv_heads
    widths = [config.intermediate_size] + ([config.moe_intermediate_size] if config.num_experts else [])
    return [tp for tp in range(1, hq + 1)
            if hq % tp == 0 and (hk % tp == 0 or tp % hk == 0) and all(w % tp == 0 for w in widths)]


def kv_heads_per_rank(config: ModelConfig, tp: int = 1) -> int:
    """KV heads one TP rank stores: ``num_kv_heads / tp``, at least one (replicated beyond)."""
    return max(1, config.num_kv_heads // tp)


def valid_dcp_sizes(config: ModelConfig, tp: int) -> list[int]:
    """Decode-context-parallel sizes for ``tp``: DCP ranks share one KV head and shard its
    sequence, so they divide the ``tp / num_kv_heads`` ranks that hold each head."""
    copies = max(1, tp // config.num_kv_heads)
    return [n for n in range(1, copies + 1) if copies % n == 0]


def parallel_problems(config: ModelConfig, tp: int, dcp: int = 1) -> list[str]:
    """Why ``config`` cannot run at ``tp`` and ``dcp`` (empty when it can), naming the sizes it can."""
    if tp not in valid_tp_sizes(config):
        moe = f", moe_intermediate_size={config.moe_intermediate_size}" if config.num_experts else ""
        return [f"tp={tp} does not split num_attention_heads={config.num_heads}, "
                f"num_key_value_heads={config.num_kv_heads}, intermediate_size={config.intermediate_size}{moe}; "
                "valid tp sizes: "
                f"{', '.join(map(str, valid_tp_sizes(config)))}"]
    if dcp not in valid_dcp_sizes(config, tp):
        return [f"dcp={dcp} at tp={tp}: each of the {config.num_kv_heads} KV heads is held by "
                f"{max(1, tp // config.num_kv_heads)} rank(s), which dcp must divide; valid dcp sizes at tp={tp}: "
                f"{', '.join(map(str, valid_dcp_sizes(config, tp)))}"]
    return []


# ---- checkpoint names -----------------------------------------------------------------------------

def _text_prefix(config: ModelConfig) -> str:
    if config.architecture == "falcon":
        return "transformer."
    return "model.language_model." if config.is_multimodal else "model."


def layer_prefix(config: ModelConfig, layer: int) -> str:
    """Name prefix of decoder layer ``layer``'s tensors (``model.layers.3.``, ``transformer.h.3.`` ...)."""
    if config.architecture == "falcon":
        return f"transformer.h.{layer}."
    return f"{_text_prefix(config)}layers.{layer}."


def embedding_name(config: ModelConfig) -> str:
    word = "word_embeddings" if config.architecture == "falcon" else "embed_tokens"
    return f"{_text_prefix(config)}{word}.weight"


def final_norm_prefix(config: ModelConfig) -> str:
    """``{prefix}weight`` (and with LayerNorm ``{prefix}bias``) of the final norm."""
    return _text_prefix(config) + ("ln_f." if config.architecture == "falcon" else "norm.")


# ---- the table ------------------------------------------------------------------------------------

def _norm(name: str, width: int, part: str, layer: int | None, layer_norm: bool) -> list[TensorShape]:
    out = [TensorShape(f"{name}.weight", (width,), part, layer=layer, kind="norm")]
    if layer_norm:
        out.append(TensorShape(f"{name}.bias", (width,), part, layer=layer, kind="norm"))
    return out


def _linear(name: str, out_f: int, in_f: int, split: str, layer: int | None, bias: bool,
            part: str = "layer") -> list[TensorShape]:
    out = [TensorShape(f"{name}.weight", (out_f, in_f), part, split, layer)]
    if bias:  # a row-parallel bias is added once, after the reduction: replicated
        out.append(TensorShape(f"{name}.bias", (out_f,), part, "replicated" if split == "row" else split, layer,
                               kind="bias"))
    return out


def _falcon_layer(config: ModelConfig, layer: int, p: str) -> list[TensorShape]:
    h, d, hq, hk = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
    ln = config.norm == "layer"
    t: list[TensorShape] = []
    if config.parallel_attn and config.num_ln_in_parallel_attn == 2:
        t += _norm(p + "ln_attn", h, "layer", layer, ln) + _norm(p + "ln_mlp", h, "layer", layer, ln)
    else:
        t += _norm(p + "input_layernorm", h, "layer", layer, ln)
        if not config.parallel_attn:
            t += _norm(p + "post_attention_layernorm", h, "layer", layer, ln)
    t += _linear(p + "self_attention.query_key_value", (hq + 2 * hk) * d, h, "fused_qkv", layer,
                 config.attention_bias)
    t += _linear(p + "self_attention.dense", h, hq * d, "row", layer, config.attention_bias)
    t += _linear(p + "mlp.dense_h_to_4h", config.intermediate_size, h, "column", layer, config.mlp_bias)
    t += _linear(p + "mlp.dense_4h_to_h", h, config.intermediate_size, "row", layer, config.mlp_bias)
    return t


def layer_tensors(config: ModelConfig, layer: int) -> list[TensorShape]:
    """The weights of decoder layer ``layer``."""
    if not 0 <= layer < config.num_layers:
        raise ValueError(f"layer_tensors: layer must be in [0, {config.num_layers}), got {layer}")
    p = layer_prefix(config, layer)
    if config.architecture == "falcon":
        return _falcon_layer(config, layer, p)
    h, d, hq, hk = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
    ln = config.norm == "layer"
    t = _norm(p + "input_layernorm", h, "layer", layer, ln)
    t += _norm(p + "post_attention_layernorm", h, "layer", layer, ln)
    bias = config.attention_bias
    t += _linear(p + "self_attn.q_proj", hq * d, h, "column", layer, bias)
    t += _linear(p + "self_attn.k_proj", hk * d, h, "kv_column", layer, bias)
    t += _linear(p + "self_attn.v_proj", hk * d, h, "kv_column", layer, bias)
    t += _linear(p + "self_attn.o_proj", h, hq * d, "row", layer, bias)
    if config.qk_norm:
        t += [TensorShape(p + "self_attn.q_norm.weight", (d,), "layer", layer=layer, kind="norm"),
              TensorShape(p + "self_attn.k_norm.weight", (d,), "layer", layer=layer, kind="norm")]
    if config.is_moe_layer(layer):
        e, mi = config.num_experts, config.moe_intermediate_size
        t += [TensorShape(p + "mlp.gate.weight", (e, h), "layer", layer=layer, kind="router"),
              TensorShape(p + "mlp.experts.gate_up_proj", (e, 2 * mi, h), "layer", "expert_column", layer,
                          kind="expert"),
              TensorShape(p + "mlp.experts.down_proj", (e, h, mi), "layer", "expert_row", layer, kind="expert")]
    else:
        inter, mb = config.intermediate_size, config.mlp_bias
        t += _linear(p + "mlp.gate_proj", inter, h, "column", layer, mb)
        t += _linear(p + "mlp.up_proj", inter, h, "column", layer, mb)
        t += _linear(p + "mlp.down_proj", h, inter, "row", layer, mb)
    return t


def vision_tensors(config: ModelConfig) -> list[TensorShape]:
    """The Qwen3-VL vision tower: patch embedding, position embedding, blocks, merger and the
    deepstack mergers (empty for a text-only model)."""
    v = config.vision_config
    if v is None:
        return []
    vh, vi, ps = v.hidden_size, v.intermediate_size, v.patch_size
    t = [TensorShape("model.visual.patch_embed.proj.weight", (vh, v.in_channels, v.temporal_patch_size, ps, ps),
                     "vision", kind="conv"),
         TensorShape("model.visual.patch_embed.proj.bias", (vh,), "vision", kind="bias"),
         TensorShape("model.visual.pos_embed.weight", (v.num_position_embeddings, vh), "vision", kind="embedding")]
    for b in range(v.depth):
        p = f"model.visual.blocks.{b}."
        t += _norm(p + "norm1", vh, "vision", None, True) + _norm(p + "norm2", vh, "vision", None, True)
        t += _linear(p + "attn.qkv", 3 * vh, vh, "replicated", None, True, "vision")
        t += _linear(p + "attn.proj", vh, vh, "replicated", None, True, "vision")
        t += _linear(p + "mlp.linear_fc1", vi, vh, "replicated", None, True, "vision")
        t += _linear(p + "mlp.linear_fc2", vh, vi, "replicated", None, True, "vision")
    merged = v.merged_width
    for name, norm_width in [("model.visual.merger", vh)] + [(f"model.visual.deepstack_merger_list.{i}", merged)
                                                              for i in range(len(v.deepstack_visual_indexes))]:
        t += _norm(name + ".norm", norm_width, "vision", None, True)
        t += _linear(name + ".linear_fc1", merged, merged, "replicated", None, True, "vision")
        t += _linear(name + ".linear_fc2", v.out_hidden_size, merged, "replicated", None, True, "vision")
    return t


def embedding_tensors(config: ModelConfig) -> list[TensorShape]:
    return [TensorShape(embedding_name(config), (config.vocab_size, config.hidden_size), "embedding", "vocab",
                        kind="embedding")]


def final_norm_tensors(config: ModelConfig) -> list[TensorShape]:
    return _norm(final_norm_prefix(config).removesuffix("."), config.hidden_size, "final_norm", None,
                 config.norm == "layer")


def lm_head_tensors(config: ModelConfig) -> list[TensorShape]:
    return [TensorShape(LM_HEAD, (config.vocab_size, config.hidden_size), "lm_head", "vocab")]


def model_tensors(config: ModelConfig) -> list[TensorShape]:
    """Every stored tensor of the whole model (a tied LM head is the embedding: not listed twice)."""
    return stage_tensors(config, range(config.num_layers), first=True, last=True)


def stage_tensors(config: ModelConfig, layers: range, *, first: bool, last: bool) -> list[TensorShape]:
    """The tensors a pipeline stage stores: decoder ``layers`` (may be empty), plus the vision tower
    and the embedding when it is the ``first`` stage, the final norm and LM head when the ``last``."""
    t: list[TensorShape] = []
    if first:
        t += vision_tensors(config) + embedding_tensors(config)
    for layer in layers:
        t += layer_tensors(config, layer)
    if last:
        t += final_norm_tensors(config)
        if not config.tie_word_embeddings or not first:
            t += lm_head_tensors(config)  # tied, on its own stage: a copy of the embedding
    return t


def rank_numel(config: ModelConfig, tensor: TensorShape, sharding: Sharding = Sharding()) -> int:
    """Elements of ``tensor`` one rank holds under ``sharding``."""
    tp, n, split = sharding.tp, tensor.numel, tensor.split
    if split in ("expert_column", "expert_row"):
        return n // (sharding.ep * sharding.moe_tp)
    if tp == 1 or split == "replicated":
        return n
    if split in ("column", "row"):
        return n // tp
    if split == "kv_column":
        return n // config.num_kv_heads * kv_heads_per_rank(config, tp)
    if split == "fused_qkv":
        per_head = n // (config.num_heads + 2 * config.num_kv_heads)
        return per_head * (config.num_heads // tp + 2 * kv_heads_per_rank(config, tp))
    if split == "vocab":
        return math.ceil(config.vocab_size / tp) * (n // config.vocab_size)
    raise ValueError(f"rank_numel: unknown split {split!r}; expected one of {SPLITS}")


def count(config: ModelConfig, tensors: Iterable[TensorShape], sharding: Sharding = Sharding()) -> int:
    """Elements one rank holds of ``tensors``."""
    return sum(rank_numel(config, t, sharding) for t in tensors)


def stage_param_counts(config: ModelConfig, ranges: Sequence[tuple[int, int]],
                       sharding: Sharding = Sharding()) -> list[int]:
    """Parameters one rank of each stage holds, for stages owning layers ``[start, end)`` in order."""
    last = len(ranges) - 1
    return [count(config, stage_tensors(config, range(a, b), first=i == 0, last=i == last), sharding)
            for i, (a, b) in enumerate(ranges)]


def decode_read_params(config: ModelConfig, layer: int) -> int:
    """Weights one decoded token reads in ``layer``'s matmuls: every dense matrix and its bias, the
    router, and ``num_experts_per_tok`` of the experts (norms left out: read too, but tiny)."""
    total = 0
    for t in layer_tensors(config, layer):
        if t.kind == "expert":
            total += t.numel // config.num_experts * config.num_experts_per_tok
        elif t.kind in ("linear", "bias", "router"):
            total += t.numel
    return total


def kv_bytes_per_token_layer(config: ModelConfig, kv_bytes: int, tp: int = 1) -> int:
    """K and V of one token in one layer on one TP rank (``2 * kv_heads * head_dim * bytes``)."""
    return 2 * kv_heads_per_rank(config, tp) * config.head_dim * kv_bytes

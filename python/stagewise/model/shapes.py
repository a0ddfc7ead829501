"""The table of every weight tensor of a model, from its config alone: the one place that knows
each tensor's checkpoint name, shape, owner and tensor-parallel split. The loader reads what it
loads from here and the planner counts parameters, stage bytes and shard bytes from here. A decoder
layer's rows, and the names of the embedding, final norm and layers, come from the model's
architecture (:mod:`stagewise.model.architectures`); a row and its split kinds are
:mod:`stagewise.model.rows`.

Names and shapes are those of the transformers model built from the same config.json (``[out, in]``
linears, transformers 5's fused ``mlp.experts.gate_up_proj``, Falcon's fused ``query_key_value``,
the Qwen3-VL vision tower), so the totals equal its parameter count. Checkpoint files that store a
tensor in another form (one tensor per expert, a tied LM head left out) are mapped onto these
entries by :mod:`stagewise.model.loader`.

Ownership by pipeline stage: the first stage holds the embedding and the vision tower, every stage
its decoder layers, the last stage the final norm and the LM head. With tied embeddings a single
stage stores the matrix once; a pipeline's last stage holds its own copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stagewise.kv.cache import kv_row_bytes
from stagewise.model import architectures
from stagewise.model.config import ModelConfig
from stagewise.model.rows import SPLITS, TensorShape, kv_heads_per_rank, linear_rows, norm_rows

LM_HEAD = "lm_head.weight"


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
    moe = config.moe
    if moe is not None:
        if moe.num_experts % sharding.ep:
            raise ValueError(f"expert parallel: ep={sharding.ep} must divide num_experts={moe.num_experts}")
        if moe.intermediate_size % sharding.moe_tp:
            raise ValueError(f"expert parallel: moe_tp={sharding.moe_tp} must divide "
                             f"moe_intermediate_size={moe.intermediate_size}")


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """The tp sizes the model allows: divisors of the query heads that divide the KV heads or are a
    multiple of them, and divide the MLP's (and the experts') intermediate size."""
    hq, hk = config.num_heads, config.num_kv_heads
    widths = [config.intermediate_size] + ([config.moe.intermediate_size] if config.moe else [])
    return [tp for tp in range(1, hq + 1)
            if hq % tp == 0 and (hk % tp == 0 or tp % hk == 0) and all(w % tp == 0 for w in widths)]


def valid_dcp_sizes(config: ModelConfig, tp: int) -> list[int]:
    """Decode-context-parallel sizes for ``tp``: DCP ranks share one KV head and shard its
    sequence, so they divide the ``tp / num_kv_heads`` ranks that hold each head."""
    copies = max(1, tp // config.num_kv_heads)
    return [n for n in range(1, copies + 1) if copies % n == 0]


def parallel_problems(config: ModelConfig, tp: int, dcp: int = 1) -> list[str]:
    """Why ``config`` cannot run at ``tp`` and ``dcp`` (empty when it can), naming the sizes it can."""
    if tp not in valid_tp_sizes(config):
        moe = f", moe_intermediate_size={config.moe.intermediate_size}" if config.moe else ""
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

def layer_prefix(config: ModelConfig, layer: int) -> str:
    """Name prefix of decoder layer ``layer``'s tensors (``model.layers.3.``, ``transformer.h.3.`` ...)."""
    return architectures.of(config).layer_prefix(layer, config.is_multimodal)


def embedding_name(config: ModelConfig) -> str:
    arch = architectures.of(config)
    return arch.text_prefix(config.is_multimodal) + arch.embedding


def final_norm_name(config: ModelConfig) -> str:
    """``{name}.weight`` (and with LayerNorm ``{name}.bias``) are the final norm's tensors."""
    arch = architectures.of(config)
    return arch.text_prefix(config.is_multimodal) + arch.final_norm


# ---- the table ------------------------------------------------------------------------------------

def layer_tensors(config: ModelConfig, layer: int) -> list[TensorShape]:
    """The weights of decoder layer ``layer``."""
    if not 0 <= layer < config.num_layers:
        raise ValueError(f"layer_tensors: layer must be in [0, {config.num_layers}), got {layer}")
    arch = architectures.of(config)
    return arch.layer_tensors(config, layer, arch.layer_prefix(layer, config.is_multimodal))


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
        t += norm_rows(p + "norm1", vh, "vision", None, True) + norm_rows(p + "norm2", vh, "vision", None, True)
        t += linear_rows(p + "attn.qkv", 3 * vh, vh, "replicated", None, True, "vision")
        t += linear_rows(p + "attn.proj", vh, vh, "replicated", None, True, "vision")
        t += linear_rows(p + "mlp.linear_fc1", vi, vh, "replicated", None, True, "vision")
        t += linear_rows(p + "mlp.linear_fc2", vh, vi, "replicated", None, True, "vision")
    merged = v.merged_width
    for name, norm_width in [("model.visual.merger", vh)] + [(f"model.visual.deepstack_merger_list.{i}", merged)
                                                              for i in range(len(v.deepstack_visual_indexes))]:
        t += norm_rows(name + ".norm", norm_width, "vision", None, True)
        t += linear_rows(name + ".linear_fc1", merged, merged, "replicated", None, True, "vision")
        t += linear_rows(name + ".linear_fc2", v.out_hidden_size, merged, "replicated", None, True, "vision")
    return t


def embedding_tensors(config: ModelConfig) -> list[TensorShape]:
    return [TensorShape(embedding_name(config), (config.vocab_size, config.hidden_size), "embedding", "vocab",
                        kind="embedding")]


def final_norm_tensors(config: ModelConfig) -> list[TensorShape]:
    return architectures.of(config).final_norm_tensors(config, final_norm_name(config))


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
            total += t.numel // config.moe.num_experts * config.moe.num_experts_per_tok
        elif t.kind in ("linear", "bias", "router"):
            total += t.numel
    return total


def kv_bytes_per_token_layer(config: ModelConfig, kv_bytes: int = 2, tp: int = 1, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token in one layer on one TP rank: ``2 * kv_heads * row``, a row
    (:func:`stagewise.kv.cache.kv_row_bytes`) ``head_dim * kv_bytes`` in the activations' dtype
    (``auto``) or a compact cache's ``head_dim`` codes and scale."""
    return 2 * kv_heads_per_rank(config, tp) * kv_row_bytes(config.head_dim, kv_bytes, kv_cache_dtype)

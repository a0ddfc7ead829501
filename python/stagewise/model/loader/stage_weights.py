"""The weights of one pipeline stage: layers ``[start, end)``, with the embedding on the first
stage and the final norm + LM head on the last, optionally one tensor-parallel shard of them.

Names are the checkpoint's HF names (per-expert tensors for Qwen3-MoE, Falcon's fused
``query_key_value``). Shapes are checked against the :class:`ModelConfig` from the file
headers before anything is read.

Tensor parallelism (Megatron layout, torch ``[out, in]`` weights): q/k/v, gate/up are
column-parallel (rank takes a block of rows, dim 0, whole heads); o/down are row-parallel
(a block of columns, dim 1), their biases stay whole (added once, after the all-reduce).
With more ranks than KV heads each KV head is replicated on ``tp_size / num_kv_heads``
consecutive ranks. Embedding, norms, router and LM head are replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from stagewise.model.checkpoint import Checkpoint, open_checkpoint
from stagewise.model.config import ModelConfig
from stagewise.model.quant import QuantizedWeight, check_precision

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Shape = tuple[int, ...]


def _prefix(cfg: ModelConfig) -> str:
    if cfg.architecture == "falcon":
        return "transformer."
    return "model.language_model." if cfg.is_multimodal else "model."


def _linear(out: dict[str, Shape], name: str, rows: int, cols: int, bias: bool) -> None:
    out[f"{name}.weight"] = (rows, cols)
    if bias:
        out[f"{name}.bias"] = (rows,)


def layer_shapes(cfg: ModelConfig, layer: int) -> dict[str, Shape]:
    """HF name -> full shape of every tensor decoder layer ``layer`` needs."""
    h, hd, out = cfg.hidden_size, cfg.head_dim, {}
    if cfg.architecture == "falcon":
        p = f"transformer.h.{layer}."
        _linear(out, p + "self_attention.query_key_value", (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h,
                cfg.attention_bias)
        _linear(out, p + "self_attention.dense", h, cfg.num_heads * hd, cfg.attention_bias)
        _linear(out, p + "mlp.dense_h_to_4h", cfg.intermediate_size, h, cfg.mlp_bias)
        _linear(out, p + "mlp.dense_4h_to_h", h, cfg.intermediate_size, cfg.mlp_bias)
        if cfg.new_decoder_architecture and cfg.num_ln_in_parallel_attn == 2:
            norms = ["ln_attn", "ln_mlp"]
        else:
            norms = ["input_layernorm"] + ([] if cfg.parallel_attn else ["post_attention_layernorm"])
        for norm in norms:
            out[p + norm + ".weight"] = out[p + norm + ".bias"] = (h,)
        return out
    p = f"{_prefix(cfg)}layers.{layer}."
    for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads), ("v_proj", cfg.num_kv_heads)):
        _linear(out, p + "self_attn." + proj, heads * hd, h, cfg.attention_bias)
    _linear(out, p + "self_attn.o_proj", h, cfg.num_heads * hd, cfg.attention_bias)
    if cfg.qk_norm:
        out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = (hd,)
    out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = (h,)
    if cfg.architecture == "qwen3_moe" and cfg.is_moe_layer(layer):
        out[p + "mlp.gate.weight"] = (cfg.num_experts, h)
        mlps, width = [f"mlp.experts.{e}." for e in range(cfg.num_experts)], cfg.moe_intermediate_size
    else:
        mlps, width = ["mlp."], cfg.intermediate_size
    for mlp in mlps:
        _linear(out, p + mlp + "gate_proj", width, h, cfg.mlp_bias)
        _linear(out, p + mlp + "up_proj", width, h, cfg.mlp_bias)
        _linear(out, p + mlp + "down_proj", h, width, cfg.mlp_bias)
    return out


def stage_shapes(cfg: ModelConfig, start: int, end: int) -> dict[str, tuple[str, Shape]]:
    """Output name -> (checkpoint name it is read from, full shape) for layers ``[start, end)``."""
    out: dict[str, tuple[str, Shape]] = {}
    embed = "transformer.word_embeddings.weight" if cfg.architecture == "falcon" else _prefix(cfg) + "embed_tokens.weight"
    vocab = (cfg.vocab_size, cfg.hidden_size)
    if start == 0:
        out[embed] = (embed, vocab)
    for layer in range(start, end):
        out.update((name, (name, shape)) for name, shape in layer_shapes(cfg, layer).items())
    if end == cfg.num_layers:
        if cfg.architecture == "falcon":
            out["transformer.ln_f.weight"] = ("transformer.ln_f.weight", (cfg.hidden_size,))
            out["transformer.ln_f.bias"] = ("transformer.ln_f.bias", (cfg.hidden_size,))
        else:
            out[_prefix(cfg) + "norm.weight"] = (_prefix(cfg) + "norm.weight", (cfg.hidden_size,))
        # Tied: the LM head is the embedding matrix (a stored lm_head.weight copy is ignored, as HF does).
        out["lm_head.weight"] = (embed if cfg.tie_word_embeddings else "lm_head.weight", vocab)
    return out


def tp_slice(cfg: ModelConfig, name: str, shape: Shape, rank: int, size: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of rank's shard of tensor ``name``; None when it is replicated."""
    if size == 1:
        return None
    leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
    proj, kind = leaf[0], leaf[1]
    if proj == "q_proj" or (proj in ("gate_proj", "up_proj")):
        dim, parts, index = 0, size, rank
    elif proj in ("k_proj", "v_proj"):
        dim = 0
        if cfg.num_kv_heads >= size:
            parts, index = size, rank
        else:  # fewer KV heads than ranks: each head is shared by tp_size / num_kv_heads ranks
            parts, index = cfg.num_kv_heads, rank // (size // cfg.num_kv_heads)
    elif proj in ("o_proj", "down_proj") and kind == "weight":
        dim, parts, index = 1, size, rank
    else:
        return None
    block = shape[dim] // parts
    return dim, index * block, (index + 1) * block


def _check_tp(cfg: ModelConfig, rank: int, size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"load_stage_weights: tp_size must be a positive integer, got {size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"load_stage_weights: tp_rank must be an integer in [0, {size}), got {rank!r}")
    if size == 1:
        return
    if cfg.architecture == "falcon":
        raise ValueError(f"load_stage_weights: tp_size={size} is not supported for falcon "
                         "(its fused query_key_value is not split); expected tp_size=1")
    widths = {"num_heads": cfg.num_heads}
    if cfg.architecture != "qwen3_moe" or not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        widths["intermediate_size"] = cfg.intermediate_size
    if cfg.architecture == "qwen3_moe":
        widths["moe_intermediate_size"] = cfg.moe_intermediate_size
    for field, value in widths.items():
        if value % size:
            raise ValueError(f"load_stage_weights: tp_size={size} must divide {field}={value}")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(f"load_stage_weights: tp_size={size} and num_kv_heads={kv}: one must divide the other")


def _target_dtype(dtype: str | torch.dtype) -> torch.dtype | None:
    if dtype == "auto":
        return None
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in DTYPES.values():
        raise ValueError(f"load_stage_weights: dtype must be 'auto', float32, bfloat16 or float16, got {dtype!r}")
    return dtype


def keeps_quantized(dtype: torch.dtype | None, quantized: bool | None) -> bool:
    """Whether block-quantised GGUF matrices stay in their blocks (see :func:`load_stage_weights`)."""
    if quantized is not None and not isinstance(quantized, bool):
        raise ValueError(f"load_stage_weights: quantized must be True, False or None, got {quantized!r}")
    return quantized if quantized is not None else dtype in (None, torch.float32)


def load_stage_weights(checkpoint: Checkpoint | str | Path, start_layer: int, end_layer: int, *,
                       tp_rank: int = 0, tp_size: int = 1,
                       dtype: str | torch.dtype = "auto", quantized: bool | None = None,
                       linear_precision: str = "exact",
                       progress: Callable[[int, int, int], None] | None = None
                       ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """HF name -> tensor for decoder layers ``[start_layer, end_layer)`` of ``checkpoint``.

    Includes the embedding when ``start_layer == 0`` and the final norm + ``lm_head.weight``
    when ``end_layer == num_layers`` (tied: the embedding matrix, read once). Only these
    tensors, and with ``tp_size > 1`` only rank's shard of them where the format allows,
    are read. ``dtype="auto"`` keeps the stored dtype (quantized GGUF: float32).

    Block-quantised GGUF matrices (Q4_0, Q4_1, Q8_0: linears, embedding, LM head) come back as
    :class:`QuantizedWeight` — their blocks as stored, run by ``stagewise.ops.quant_linear`` with
    the exact dequantised values — when ``quantized`` is True, or by default (``None``) when the
    stage computes in float32 (``dtype`` "auto", which is float32 for a quantised GGUF, or
    "float32"): float32 maths on the same values as dequantising first, with 1/6 (Q4_1) of the
    bytes. With bfloat16/float16 they are dequantised and rounded to that dtype, as with
    ``quantized=False``. A row-parallel shard of a quantised matrix must split ``in`` on block
    boundaries (32 weights), else ValueError.

    ``linear_precision="int8"`` makes those blocks multiply with x quantised to int8 per block
    (:func:`stagewise.ops.quant_linear_int8`: approximate, CPU only); it needs them kept in
    their blocks, else ValueError. The default ``"exact"`` uses the exact dequantised values.

    ``progress(done, total, nbytes)``, when given, is called once before the first read and
    after each tensor read: ``done`` of ``total`` tensors read so far (a tied matrix counts
    once) and ``nbytes`` bytes taken from the checkpoint for them (its ``bytes_read`` growth).
    """
    ckpt = open_checkpoint(checkpoint)
    cfg = ckpt.config
    n = cfg.num_layers
    for field, value in (("start_layer", start_layer), ("end_layer", end_layer)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"load_stage_weights: {field} must be an integer, got {value!r}")
    if not 0 <= start_layer < end_layer <= n:
        raise ValueError(f"load_stage_weights: layer range [{start_layer}, {end_layer}) must be non-empty "
                         f"and within [0, {n})")
    _check_tp(cfg, tp_rank, tp_size)
    target = _target_dtype(dtype)
    keep = keeps_quantized(target, quantized)
    check_precision("load_stage_weights", linear_precision)
    plan = stage_shapes(cfg, start_layer, end_layer)
    stored = ckpt.names()
    missing = sorted({src for src, _ in plan.values()} - stored)
    if missing:
        raise ValueError(f"checkpoint {str(ckpt.path)!r}: tensors needed by layers [{start_layer}, {end_layer}) "
                         f"are missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    for name, (src, expected) in plan.items():
        if ckpt.shape(src) != expected:
            raise ValueError(f"checkpoint {str(ckpt.path)!r}: tensor {src!r} has shape {list(ckpt.shape(src))}, "
                             f"but the config expects {list(expected)}")
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    read: dict[str, torch.Tensor | QuantizedWeight] = {}  # by source name, so a tied matrix is read once
    total, start_bytes = len({src for src, _ in plan.values()}), ckpt.bytes_read
    if progress is not None:
        progress(0, total, 0)
    for name, (src, shape) in plan.items():
        if src not in read:
            piece = tp_slice(cfg, name, shape, tp_rank, tp_size)
            if keep and ckpt.qtype(src) is not None:
                tensor = ckpt.read_quantized(src, *(piece or ()))
                read[src] = tensor if target is None else tensor.to(dtype=target)
            else:
                tensor = ckpt.read(src) if piece is None else ckpt.read(src, *piece)
                read[src] = tensor if target is None else tensor.to(target)
            if progress is not None:
                progress(len(read), total, ckpt.bytes_read - start_bytes)
        out[name] = read[src]
    if linear_precision != "exact":
        if not any(isinstance(w, QuantizedWeight) for w in out.values()):
            raise ValueError(f"load_stage_weights: linear_precision={linear_precision!r} applies to block-quantised "
                             f"GGUF matrices kept in their blocks, and layers [{start_layer}, {end_layer}) of "
                             f"{str(ckpt.path)!r} have none at dtype={dtype!r}, quantized={quantized!r} (it needs a "
                             f"Q4_0/Q4_1/Q8_0 GGUF run in float32)")
        out = {k: w.with_precision(linear_precision) if isinstance(w, QuantizedWeight) else w for k, w in out.items()}
    return out

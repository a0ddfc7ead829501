"""The weights of one pipeline stage, optionally one tensor-parallel rank's shard of them:
decoder layers ``[start, end)``, with the embedding on the first stage and the final norm and LM
head on the last.

What a stage holds, under which names and in which shapes, comes from the table
(:mod:`stagewise.model.shapes`); where the checkpoint keeps each tensor from
:mod:`~stagewise.model.loader.storage`; which part a rank holds from
:mod:`~stagewise.model.loader.sharding`. Shapes are checked against the config from the file
headers before anything is read, and only the stage's tensors, and only the rank's cut of them,
are read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from stagewise import ops
from stagewise.model import shapes
from stagewise.model.rows import TensorShape
from stagewise.model.loader.checkpoint import Checkpoint
from stagewise.model.loader.sharding import Cut, check_tp, rank_cut
from stagewise.model.loader.sources import open_checkpoint
from stagewise.model.loader.storage import locate, read_cut
from stagewise.model.quant import QTYPE_NAMES, QuantizedWeight, check_precision, quantize_q8_0

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, stated: torch.dtype | None) -> torch.dtype:
    """The dtype a stage computes in: ``dtype`` (a name in :data:`DTYPES` or a torch dtype), or for
    ``"auto"`` the dtype the config ``stated`` when it is one of them, else float32."""
    if dtype == "auto":
        return stated if stated in DTYPES.values() else torch.float32
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return dtype


def resolve_device(device: str | torch.device, here: bool = True) -> torch.device:
    """The device a pipeline computes on: the CPU, or a CUDA device this machine has (unless not
    ``here``: the stages run on other machines, such as a Ray cluster's GPU nodes)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if here and dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return dev


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


def _check_range(start_layer: int, end_layer: int, num_layers: int) -> None:
    for field, value in (("start_layer", start_layer), ("end_layer", end_layer)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"load_stage_weights: {field} must be an integer, got {value!r}")
    if not 0 <= start_layer < end_layer <= num_layers:
        raise ValueError(f"load_stage_weights: layer range [{start_layer}, {end_layer}) must be non-empty "
                         f"and within [0, {num_layers})")


def _check_blocks(ckpt: Checkpoint, name: str, cut: Cut, tp_size: int) -> None:
    """A cut across a block-quantised matrix's inputs must keep whole blocks (32 or 256 weights)."""
    block = ops.QUANT_BLOCK_WEIGHTS[ckpt.qtype(name)]
    for a, b in cut.ranges:
        if a % block or b % block:
            raise ValueError(
                f"load_stage_weights: tp_size={tp_size} gives a rank inputs [{a}, {b}) of tensor {name!r} "
                f"{list(ckpt.shape(name))}, stored as {QTYPE_NAMES[ckpt.qtype(name)]} in blocks of {block} weights; "
                f"a cut must fall on block boundaries (choose a tp_size that does, or load with quantized=False "
                f"to dequantise)")


def load_stage_weights(checkpoint: Checkpoint | str | Path, start_layer: int, end_layer: int, *,
                       tp_rank: int = 0, tp_size: int = 1,
                       dtype: str | torch.dtype = "auto", quantized: bool | None = None,
                       linear_precision: str = "exact",
                       progress: Callable[[int, int, int], None] | None = None
                       ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """HF name -> tensor for decoder layers ``[start_layer, end_layer)`` of ``checkpoint``.

    Names and shapes are the table's (:mod:`stagewise.model.shapes`), whatever form the checkpoint
    stores them in (Qwen3-MoE experts come back fused as ``mlp.experts.gate_up_proj`` and
    ``down_proj``). Includes the embedding when ``start_layer == 0`` and the final norm +
    ``lm_head.weight`` when ``end_layer == num_layers`` (tied: the embedding matrix, read once; on a
    stage holding both, one tensor under both names). The vision tower of a multimodal model is read
    by the first stage only, whole, by its TP rank 0 only (which runs it for the stage).
    ``dtype="auto"`` keeps the stored dtype (quantized GGUF: float32).

    With ``tp_size > 1`` each tensor is rank ``tp_rank``'s shard (see
    :mod:`~stagewise.model.loader.sharding`), and only that is read where the format allows; its
    shape is what :func:`stagewise.model.shapes.rank_numel` counts for the rank. Row-parallel
    biases are whole on every rank: the row-parallel linear adds them once, after the reduction.

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
    their blocks. A dense float32 checkpoint's matmul weights are quantised to Q8_0 blocks for it
    at load (whose ``in`` is whole blocks of 32; the others stay dense); anything else is a
    ValueError. The default ``"exact"`` uses the exact dequantised values.

    ``progress(done, total, nbytes)``, when given, is called once before the first read and
    after each tensor read: ``done`` of ``total`` tensors read so far (a tied matrix counts
    once) and ``nbytes`` bytes taken from the checkpoint for them (its ``bytes_read`` growth).
    """
    ckpt = open_checkpoint(checkpoint)
    cfg = ckpt.config
    _check_range(start_layer, end_layer, cfg.num_layers)
    check_tp(cfg, tp_rank, tp_size)
    target = _target_dtype(dtype)
    keep = keeps_quantized(target, quantized)
    check_precision("load_stage_weights", linear_precision)
    first, last = start_layer == 0, end_layer == cfg.num_layers
    table = shapes.stage_tensors(cfg, range(start_layer, end_layer), first=first, last=last)
    if tp_rank > 0:  # the stage's leader runs the vision tower and hands its output to the other ranks
        table = [t for t in table if t.part != "vision"]
    sources = locate(ckpt, cfg, table, f"layers [{start_layer}, {end_layer})")
    cuts = {t.name: rank_cut(cfg, t, tp_rank, tp_size) for t in table}
    if keep:
        for t in table:
            source, cut = sources[t.name], cuts[t.name]
            if cut.dim == 1 and not source.per_expert and ckpt.qtype(source.name) is not None:
                _check_blocks(ckpt, source.name, cut, tp_size)
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    start_bytes = ckpt.bytes_read
    if progress is not None:
        progress(0, len(table), 0)
    for t in table:
        tensor = read_cut(ckpt, sources[t.name], cuts[t.name], keep)
        out[t.name] = tensor if target is None else tensor.to(dtype=target)
        if progress is not None:
            progress(len(out), len(table), ckpt.bytes_read - start_bytes)
    if first and last and cfg.tie_word_embeddings:
        out[shapes.LM_HEAD] = out[shapes.embedding_name(cfg)]
    if linear_precision != "exact":
        if not any(isinstance(w, QuantizedWeight) for w in out.values()):
            out = _dense_to_q8_0(out, table, f"layers [{start_layer}, {end_layer}) of {str(ckpt.path)!r}")
        out = {k: w.with_precision(linear_precision) if isinstance(w, QuantizedWeight) else w for k, w in out.items()}
    return out


def _dense_to_q8_0(out: dict, table: list[TensorShape], what: str) -> dict:
    """The int8 mode over a dense checkpoint: every float32 matmul weight (linear and LM head)
    whose ``in`` is whole blocks of 32, quantised to Q8_0 at load (llama.cpp's 8-bit type); the
    embedding, norms, biases, experts and the vision stem stay as they are."""
    linear = {t.name for t in table if t.kind == "linear"} | {shapes.LM_HEAD}
    names = [n for n in linear if isinstance(out.get(n), torch.Tensor) and out[n].dim() == 2
             and out[n].size(1) % 32 == 0]
    if not names or any(out[n].dtype != torch.float32 for n in names):
        raise ValueError(f"load_stage_weights: linear_precision='int8' multiplies block-quantised matrices by "
                         f"int8 activations in float32: a Q4_0/Q4_1/Q8_0/Q4_K/Q6_K GGUF, or a dense checkpoint's "
                         f"float32 matrices (quantised to Q8_0 at load); {what} have neither")
    return {**out, **{n: quantize_q8_0(out[n]) for n in names}}

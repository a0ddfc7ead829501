"""One row of the table of weight tensors (:class:`TensorShape`), the kinds of tensor-parallel
split a row may have, and the helpers an architecture writes its rows with
(:mod:`stagewise.model.architectures`). The table itself, a stage's rows and what they count, is
:mod:`stagewise.model.shapes`.

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
- ``fused_qkv``: q, k and v in one tensor, in blocks of ``head_dim`` rows whose order the
  architecture states (``Architecture.fused_qkv_heads``; Falcon's ``query_key_value``), by whole
  heads: each rank's rows are its query heads' and KV heads' blocks, in the tensor's order.
- ``vocab``: rows in blocks of ``ceil(vocab / tp)``, the last block padded with zero rows, so that
  every rank holds the same shape (embedding and LM head: vocab parallel).
- ``expert_column`` / ``expert_row``: per expert, its gate and up halves column-split, its down
  projection row-split, over ``moe_tp`` ranks; ``ep`` ranks hold ``num_experts / ep`` experts each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagewise.model.config import ModelConfig

PARTS = ("vision", "embedding", "layer", "final_norm", "lm_head")
SPLITS = ("replicated", "column", "row", "kv_column", "fused_qkv", "vocab", "expert_column", "expert_row")


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


def kv_heads_per_rank(config: ModelConfig, tp: int = 1) -> int:
    """KV heads one TP rank stores: ``num_kv_heads / tp``, at least one (replicated beyond)."""
    return max(1, config.num_kv_heads // tp)


def norm_rows(name: str, width: int, part: str, layer: int | None, bias: bool) -> list[TensorShape]:
    """``{name}.weight`` (and with ``bias``, a LayerNorm's, ``{name}.bias``), both ``[width]``."""
    out = [TensorShape(f"{name}.weight", (width,), part, layer=layer, kind="norm")]
    if bias:
        out.append(TensorShape(f"{name}.bias", (width,), part, layer=layer, kind="norm"))
    return out


def linear_rows(name: str, out_f: int, in_f: int, split: str, layer: int | None, bias: bool,
                part: str = "layer") -> list[TensorShape]:
    """``{name}.weight [out_f, in_f]`` split as ``split``, and with ``bias`` its ``{name}.bias``."""
    out = [TensorShape(f"{name}.weight", (out_f, in_f), part, split, layer)]
    if bias:  # a row-parallel bias is added once, after the reduction: replicated
        out.append(TensorShape(f"{name}.bias", (out_f,), part, "replicated" if split == "row" else split, layer,
                               kind="bias"))
    return out

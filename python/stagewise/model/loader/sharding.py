"""Which part of each weight tensor one tensor-parallel rank holds: the only place that cuts weights
for a rank. The layers take what it gives them and never split a tensor themselves.

A :class:`Cut` is a list of index ranges along one dim, taken in order and concatenated, plus zero
rows appended. Every split kind of :mod:`stagewise.model.shapes` becomes one:

- ``column``: rows ``[r * out / tp, (r + 1) * out / tp)``; ``row``: the same block of columns.
- ``kv_column``: the rows of the rank's KV heads (:func:`kv_heads_of_rank`).
- ``fused_qkv``: q, k and v in one tensor (Falcon's ``query_key_value``) by whole heads: its
  head-sized blocks of rows, in the order the architecture states (``Architecture.fused_qkv_heads``),
  of which a rank takes its query heads' and its KV heads', in that order.
- ``vocab``: rows in blocks of ``ceil(vocab / tp)``; the last ranks' blocks run past the vocabulary
  and are filled with zero rows (whose logits the gather cuts off again).
- ``expert_column``: per expert, the gate half and the up half of ``gate_up_proj [E, 2I, H]`` each
  column-split, so rank ``r`` holds ``[gate_r; up_r]``; ``expert_row``: ``down_proj [E, H, I]``
  split along ``I``. Experts are split like the dense MLP: ``moe_tp = tp``, no expert parallelism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stagewise.model import architectures, shapes
from stagewise.model.config import ModelConfig
from stagewise.model.rows import SPLITS, TensorShape
from stagewise.model.shapes import Sharding


@dataclass(frozen=True, slots=True)
class Cut:
    """One rank's part of a tensor: ``ranges`` along ``dim`` concatenated, then ``pad`` zero rows
    (dim 0) appended. ``dim`` None: the whole tensor."""

    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    pad: int = 0

    @property
    def whole(self) -> bool:
        return self.dim is None


WHOLE = Cut()


def rank_sharding(tp_size: int) -> Sharding:
    """The table's sizes for a rank of ``tp_size`` (what :func:`shapes.rank_numel` counts for it)."""
    return Sharding(tp=tp_size, moe_tp=tp_size)


def check_tp(config: ModelConfig, tp_rank: int, tp_size: int) -> None:
    """ValueError unless ``tp_rank`` of ``tp_size`` is a rank ``config`` can be split for."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor parallel: tp_size must be a positive integer, got {tp_size!r}")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor parallel: tp_rank must be an integer in [0, {tp_size}), got {tp_rank!r}")
    shapes.check_sharding(config, rank_sharding(tp_size))


def query_heads_of_rank(config: ModelConfig, tp_rank: int, tp_size: int) -> range:
    n = config.num_heads // tp_size
    return range(tp_rank * n, (tp_rank + 1) * n)


def kv_heads_of_rank(config: ModelConfig, tp_rank: int, tp_size: int) -> range:
    """The KV heads ``tp_rank`` holds: its block of ``num_kv_heads / tp_size``, or, with more ranks
    than KV heads, the one head it shares with the ``tp_size / num_kv_heads - 1`` ranks beside it
    (the query heads of those ranks are exactly the ones that read that head)."""
    hk = config.num_kv_heads
    if hk >= tp_size:
        n = hk // tp_size
        return range(tp_rank * n, (tp_rank + 1) * n)
    head = tp_rank // (tp_size // hk)
    return range(head, head + 1)


def rank_cut(config: ModelConfig, tensor: TensorShape, tp_rank: int, tp_size: int) -> Cut:
    """The part of ``tensor`` (an entry of the table) that ``tp_rank`` of ``tp_size`` holds.

    Assumes :func:`check_tp` passed; a dim the split needs to divide evenly and does not is a
    ValueError naming the tensor."""
    split = tensor.split
    if tp_size == 1 or split == "replicated":
        return WHOLE
    if split == "column":
        return Cut(0, (_block(tensor, 0, tensor.shape[0], tp_rank, tp_size),))
    if split == "row":
        return Cut(1, (_block(tensor, 1, tensor.shape[1], tp_rank, tp_size),))
    if split == "expert_row":
        return Cut(2, (_block(tensor, 2, tensor.shape[2], tp_rank, tp_size),))
    if split == "expert_column":
        half = tensor.shape[1] // 2
        a, b = _block(tensor, 1, half, tp_rank, tp_size)
        return Cut(1, ((a, b), (half + a, half + b)))
    if split == "kv_column":
        heads = kv_heads_of_rank(config, tp_rank, tp_size)
        d = tensor.shape[0] // config.num_kv_heads
        return Cut(0, ((heads.start * d, heads.stop * d),))
    if split == "fused_qkv":
        return _fused_qkv(config, tensor, tp_rank, tp_size)
    if split == "vocab":
        per_rank = math.ceil(tensor.shape[0] / tp_size)
        start = min(tp_rank * per_rank, tensor.shape[0])
        stop = min(start + per_rank, tensor.shape[0])
        return Cut(0, ((start, stop),) if stop > start else (), per_rank - (stop - start))
    raise ValueError(f"rank_cut: tensor {tensor.name!r} has split {split!r}; expected one of {SPLITS}")


def _block(tensor: TensorShape, dim: int, size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    if size % tp_size:
        raise ValueError(f"tensor parallel: tp_size={tp_size} must divide the {size} {'rows' if dim == 0 else 'columns'}"
                         f" (dim {dim}) that tensor {tensor.name!r} {list(tensor.shape)} splits")
    n = size // tp_size
    return tp_rank * n, (tp_rank + 1) * n


def _fused_qkv(config: ModelConfig, tensor: TensorShape, tp_rank: int, tp_size: int) -> Cut:
    heads = architectures.of(config).fused_qkv_heads
    if heads is None:
        raise ValueError(f"rank_cut: tensor {tensor.name!r} is fused_qkv, but architecture {config.architecture!r} "
                         "states no order of its head blocks (Architecture.fused_qkv_heads)")
    order = heads(config)
    mine = {"q": query_heads_of_rank(config, tp_rank, tp_size), "k": kv_heads_of_rank(config, tp_rank, tp_size)}
    mine["v"] = mine["k"]
    d = tensor.shape[0] // len(order)
    blocks = [(i, i + 1) for i, (kind, head) in enumerate(order) if head in mine[kind]]
    return Cut(0, tuple((a * d, b * d) for a, b in _merge(blocks)))


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent ranges joined, so that contiguous rows are read in one go."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out

"""Where each tensor of the table lives in a checkpoint, and reading one rank's cut of it.

Most tensors are stored under their table name with the table's shape. The exceptions, mapped
here and nowhere else:

- a tied LM head is the embedding matrix (a stored ``lm_head.weight`` copy is ignored, as
  transformers does);
- Qwen3-MoE checkpoints store each expert's projections apart,
  ``mlp.experts.{e}.gate_proj.weight [I, H]``, ``up_proj [I, H]`` and ``down_proj [H, I]``, where the
  table has transformers 5's fused ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows)
  and ``mlp.experts.down_proj [E, H, I]``: expert ``e``'s slice of the fused tensor is its parts
  stacked along their rows, so a rank's cut of it reads only the rank's rows or columns of each part;
- published Qwen3-VL-MoE checkpoints store the fused experts with their last two dims swapped,
  ``mlp.experts.gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` (transformers transposes a
  tensor whose shape is not its own, and saves its own layout): a rank's cut is read along the
  swapped dim and transposed back. Where a tensor is square in those dims (``H == 2I`` for
  gate_up, ``I == H`` for down) its shape cannot tell, and transformers, which asks each tensor
  alone, keeps it as stored; here the layer's other fused tensor, which cannot be square too,
  tells for both, as the checkpoint stores both one way.

(GGUF names and the multimodal ``model.language_model.`` prefix need no mapping: the GGUF reader
names its tensors as HF does, and the table uses the prefix the config implies.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stagewise import ops
from stagewise.model.config import ModelConfig
from stagewise.model.loader.checkpoint import Checkpoint
from stagewise.model.loader.sharding import Cut
from stagewise.model.quant import QuantizedWeight, cat_rows
from stagewise.model.rows import TensorShape
from stagewise.model.shapes import LM_HEAD, embedding_name

Weight = torch.Tensor | QuantizedWeight


@dataclass(frozen=True, slots=True)
class Source:
    """The checkpoint tensors holding one table tensor: ``parts[0][0]`` itself, or with
    ``per_expert`` expert ``e``'s slice as ``parts[e]`` stacked along their rows."""

    parts: tuple[tuple[str, ...], ...]
    per_expert: bool = False
    transposed: bool = False
    """Stored with dims 1 and 2 swapped (Qwen3-VL-MoE's fused experts)."""

    @property
    def name(self) -> str:
        """The checkpoint tensor (the first one of a per-expert source)."""
        return self.parts[0][0]


_PER_EXPERT = {"mlp.experts.gate_up_proj": ("gate_proj", "up_proj"), "mlp.experts.down_proj": ("down_proj",)}


def locate(ckpt: Checkpoint, config: ModelConfig, tensors: list[TensorShape], where: str) -> dict[str, Source]:
    """Table name -> :class:`Source` for ``tensors``. ValueError listing what is missing, or naming
    the first stored tensor whose shape is not the one the config implies."""
    stored = ckpt.names()
    out, missing, expected = {}, [], {}
    for t in tensors:
        name = embedding_name(config) if t.name == LM_HEAD and config.tie_word_embeddings else t.name
        if name in stored:
            swapped = t.kind == "expert" and config.is_multimodal and _stored_swapped(ckpt, stored, t)
            out[t.name] = Source(((name,),), transposed=swapped)
            expected[name] = (t.shape[0], t.shape[2], t.shape[1]) if swapped else t.shape
            continue
        source = _per_expert(config, t)
        if source is None or any(p not in stored for parts in source.parts for p in parts):
            missing.append(name if source is None else f"{name} (or per expert: {source.name}, ...)")
            continue
        out[t.name] = source
        part_rows = t.shape[1] // len(source.parts[0])
        for parts in source.parts:
            expected.update((p, (part_rows, t.shape[2])) for p in parts)
    if missing:
        raise ValueError(f"checkpoint {str(ckpt.path)!r}: tensors needed by {where} are missing: "
                         f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
    for name, shape in expected.items():
        if ckpt.shape(name) != shape:
            raise ValueError(f"checkpoint {str(ckpt.path)!r}: tensor {name!r} has shape {list(ckpt.shape(name))}, "
                             f"but the config expects {list(shape)}")
    return out


def _stored_swapped(ckpt: Checkpoint, stored: set[str], t: TensorShape) -> bool:
    """Whether fused expert tensor ``t`` is stored with dims 1 and 2 swapped: by its own shape, or
    when that is square in them, by its layer's other fused tensor's."""
    def swapped(name: str, shape: tuple[int, ...]) -> bool:
        return name in stored and ckpt.shape(name) != shape and ckpt.shape(name) == (shape[0], shape[2], shape[1])

    e, rows, cols = t.shape
    if rows != cols:
        return swapped(t.name, t.shape)
    if t.name.endswith("gate_up_proj"):  # [E, 2I, H] with H == 2I: down_proj [E, H, I] is not square
        return swapped(t.name.replace("gate_up_proj", "down_proj"), (e, cols, rows // 2))
    return swapped(t.name.replace("down_proj", "gate_up_proj"), (e, 2 * cols, rows))  # [E, H, I], I == H


def _per_expert(config: ModelConfig, t: TensorShape) -> Source | None:
    if t.kind != "expert" or t.layer is None:
        return None
    prefix, _, fused = t.name.partition("mlp.experts.")
    projections = _PER_EXPERT.get("mlp.experts." + fused)
    if not prefix or projections is None:
        return None
    return Source(tuple(tuple(f"{prefix}mlp.experts.{e}.{p}.weight" for p in projections)
                        for e in range(config.moe.num_experts)), per_expert=True)


def read_cut(ckpt: Checkpoint, source: Source, cut: Cut, keep_blocks: bool) -> Weight:
    """``cut`` of the tensor ``source`` holds: block-quantised matrices kept in their blocks when
    ``keep_blocks``, every other tensor dense (quantised ones dequantised to float32)."""
    if source.per_expert:
        return torch.stack([_read_expert(ckpt, parts, cut) for parts in source.parts])
    name = source.name
    if source.transposed:
        if cut.whole:
            return ckpt.read(name).transpose(1, 2).contiguous()
        dim = 3 - cut.dim  # the table's dim 1 is the stored dim 2 and the other way round
        return torch.cat([ckpt.read(name, dim, a, b) for a, b in cut.ranges], dim).transpose(1, 2).contiguous()
    blocks = keep_blocks and ckpt.qtype(name) is not None
    if cut.whole:
        return ckpt.read_quantized(name) if blocks else ckpt.read(name)
    pieces = [ckpt.read_quantized(name, cut.dim, a, b) if blocks else ckpt.read(name, cut.dim, a, b)
              for a, b in cut.ranges]
    if cut.pad:
        pieces.append(_zero_rows(ckpt, name, cut.pad, blocks, pieces))
    return _join(pieces, cut.dim)


def _read_expert(ckpt: Checkpoint, parts: tuple[str, ...], cut: Cut) -> torch.Tensor:
    """One expert's slice of a fused expert tensor: its ``parts`` stacked along their rows. The cut
    counts the expert dim, so its dim is one less here."""
    if cut.whole:
        return torch.cat([ckpt.read(p) for p in parts])
    dim = cut.dim - 1
    return torch.cat([_read_rows_of(ckpt, parts, dim, a, b) for a, b in cut.ranges], dim)


def _read_rows_of(ckpt: Checkpoint, parts: tuple[str, ...], dim: int, start: int, stop: int) -> torch.Tensor:
    """``[start, stop)`` along ``dim`` of ``parts`` stacked along their rows (dim 0), reading only that."""
    if dim != 0:
        return torch.cat([ckpt.read(p, dim, start, stop) for p in parts])
    pieces, offset = [], 0
    for p in parts:
        rows = ckpt.shape(p)[0]
        a, b = max(start, offset), min(stop, offset + rows)
        if a < b:
            pieces.append(ckpt.read(p, 0, a - offset, b - offset))
        offset += rows
    return torch.cat(pieces)


def _zero_rows(ckpt: Checkpoint, name: str, rows: int, blocks: bool, pieces: list[Weight]) -> Weight:
    """``rows`` rows of zeros in the tensor's own form (zero bytes are zero weights in every GGUF block type)."""
    cols = ckpt.shape(name)[1:]
    if blocks:
        qtype = ckpt.qtype(name)
        row_bytes = ops.quant_row_bytes(qtype, cols[0])
        return QuantizedWeight(torch.zeros((rows, row_bytes), dtype=torch.uint8), qtype, cols[0])
    return torch.zeros((rows, *cols), dtype=pieces[0].dtype if pieces else ckpt.dtype(name))


def _join(pieces: list[Weight], dim: int) -> Weight:
    if len(pieces) == 1:
        return pieces[0].contiguous()
    if dim == 0:
        return cat_rows(pieces)
    if any(isinstance(p, QuantizedWeight) for p in pieces):
        raise ValueError(f"storage: block-quantised pieces join along rows only, got dim {dim}")
    return torch.cat(pieces, dim)

"""GGUF block-quantised matrices kept in their blocks: :class:`QuantizedWeight`.

A linear weight ``W [out, in]`` of type Q4_0, Q4_1, Q8_0 (blocks of 32 weights), Q4_K or Q6_K
(blocks of 256) is stored as its raw GGUF rows, ``data [out, in / block_weights * block_bytes]`` uint8, and multiplied by :func:`stagewise.ops.quant_linear`
with the exact dequantised values, or with ``precision="int8"`` by
:func:`stagewise.ops.quant_linear_int8` (x quantised to int8 per block: approximate, CPU only)
over the rows packed once by :func:`stagewise.ops.quant_pack_int8` (:meth:`QuantizedWeight.for_linear`).
Rows can be sliced, permuted and concatenated freely (a row
is whole blocks); a slice along ``in`` must start and stop on a block boundary.
"""

from __future__ import annotations

import torch

from stagewise import ops
from stagewise.ops import reference

QTYPE_NAMES = {v: k for k, v in ops.QTYPES.items()}
PRECISIONS = ("exact", "int8")
"""How :meth:`QuantizedWeight.linear` multiplies: exact float32 dequantised weights, or int8 activations."""


def check_precision(where: str, precision: object) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"{where}: linear_precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


class QuantizedWeight:
    """``W [out_features, in_features]`` in GGUF blocks; ``dtype`` is the compute (activation) dtype,
    ``precision`` how :meth:`linear` multiplies (:data:`PRECISIONS`)."""

    def __init__(self, data: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype = torch.float32,
                 precision: str = "exact", packed: torch.Tensor | None = None) -> None:
        if qtype not in QTYPE_NAMES:
            raise ValueError(f"QuantizedWeight: qtype must be one of {ops.QTYPES}, got {qtype!r}")
        row_bytes = ops.quant_row_bytes(qtype, in_features)
        if (data.dtype != torch.uint8 or data.dim() != 2 or in_features % ops.QUANT_BLOCK_WEIGHTS[qtype]
                or data.size(1) != row_bytes):
            raise ValueError(f"QuantizedWeight: data must be uint8 [out, {row_bytes}] for {QTYPE_NAMES[qtype]} with "
                             f"in_features={in_features}, got {data.dtype} {list(data.shape)}")
        self.data, self.qtype, self.in_features, self.dtype = data, qtype, in_features, dtype
        self.precision = check_precision("QuantizedWeight", precision)
        self.packed = packed
        """The int8 kernel's panels of ``data`` (:meth:`for_linear`), or None."""

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.size(0), self.in_features))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def qtype_name(self) -> str:
        return QTYPE_NAMES[self.qtype]

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def __repr__(self) -> str:
        return (f"QuantizedWeight({self.qtype_name}, shape={list(self.shape)}, dtype={self.dtype}, "
                f"precision={self.precision}, device={self.device})")

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> QuantizedWeight:
        """Moves the blocks; ``dtype`` sets the compute dtype (the blocks stay as they are)."""
        data = self.data if device is None else self.data.to(device)
        return QuantizedWeight(data, self.qtype, self.in_features, dtype or self.dtype, self.precision)

    def with_precision(self, precision: str) -> QuantizedWeight:
        """The same blocks, multiplied in ``precision`` (:data:`PRECISIONS`)."""
        return QuantizedWeight(self.data, self.qtype, self.in_features, self.dtype, precision)

    def contiguous(self) -> QuantizedWeight:
        return self if self.data.is_contiguous() else self._like(self.data.contiguous(), self.in_features)

    def _like(self, data: torch.Tensor, in_features: int) -> QuantizedWeight:
        return QuantizedWeight(data, self.qtype, in_features, self.dtype, self.precision)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Rows (``dim=0``) or, on block boundaries, columns (``dim=1``) ``[start, start + length)``."""
        if dim in (0, -2):
            return self._like(self.data.narrow(0, start, length).contiguous(), self.in_features)
        if dim not in (1, -1):
            raise ValueError(f"QuantizedWeight.narrow: dim must be 0 or 1, got {dim}")
        block = ops.QUANT_BLOCK_WEIGHTS[self.qtype]
        if start % block or length % block:
            raise ValueError(f"QuantizedWeight.narrow: {self.qtype_name} stores {block} weights a block, so a slice "
                             f"of in_features must fall on block boundaries; got [{start}, {start + length}) of "
                             f"{self.in_features} (load with quantized=False to dequantise instead)")
        nbytes = ops.QUANT_BLOCK_BYTES[self.qtype]
        data = self.data.narrow(1, start // block * nbytes, length // block * nbytes).contiguous()
        return self._like(data, length)

    def map_rows(self, fn) -> QuantizedWeight:
        """The same blocks with rows rearranged by ``fn(data) -> data`` (e.g. a head permutation)."""
        return self._like(fn(self.data).contiguous(), self.in_features)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of ``parts`` one after another (one qtype and in_features, as checked)."""
        first = parts[0]
        for p in parts[1:]:
            if (p.qtype, p.in_features) != (first.qtype, first.in_features):
                raise ValueError(f"QuantizedWeight.cat: parts must share qtype and in_features, got "
                                 f"{first.qtype_name}/{first.in_features} and {p.qtype_name}/{p.in_features}")
        return first._like(torch.cat([p.data for p in parts]), first.in_features)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``W`` as a dense tensor (float32 values rounded to ``dtype``, default the compute dtype)."""
        return reference.dequantize(self.data, self.qtype).to(dtype or self.dtype)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``W`` (an embedding lookup): only those rows are dequantised."""
        return reference.dequantize(self.data[ids.reshape(-1)], self.qtype).to(self.dtype).reshape(
            *ids.shape, self.in_features)

    def for_linear(self) -> QuantizedWeight:
        """Itself, ready to multiply: with ``precision="int8"`` its rows packed for the int8 kernel
        (:func:`stagewise.ops.quant_pack_int8`) once, when a layer takes it at load time; the GGUF
        rows stay (the same tensor may also embed)."""
        if self.precision == "int8" and self.packed is None:
            self.packed = ops.quant_pack_int8(self.data.contiguous(), self.qtype)
        return self

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` through :func:`stagewise.ops.quant_linear` (``precision="exact"``) or
        :func:`stagewise.ops.quant_linear_int8` (``"int8"``, over the packed rows of :meth:`for_linear`)."""
        if self.precision == "int8":
            return ops.quant_linear_int8(x, self.for_linear().packed, self.qtype, self.data.size(0), bias)
        return ops.quant_linear(x, self.data, self.qtype, bias)


def quantize_q8_0(w: torch.Tensor) -> QuantizedWeight:
    """A dense ``W [out, in]`` (``in`` a multiple of 32) in Q8_0 blocks, by the GGUF project's own
    quantiser (``gguf.quants``: llama.cpp's rounding, bit for bit), to multiply in the int8 mode."""
    import gguf  # only the int8 mode over dense weights needs it

    if w.dim() != 2 or w.size(1) % 32 or not w.is_floating_point():
        raise ValueError(f"quantize_q8_0: expected a floating-point [out, in] matrix with in a multiple of 32, "
                         f"got {w.dtype} {list(w.shape)}")
    blocks = gguf.quants.quantize(w.detach().float().cpu().numpy(), gguf.GGMLQuantizationType.Q8_0)
    return QuantizedWeight(torch.from_numpy(blocks), ops.QTYPES["Q8_0"], w.size(1), torch.float32, "int8")


def cat_rows(parts: list) -> torch.Tensor | QuantizedWeight:
    """Concatenate weights along the output dim: tensors by torch.cat, quantised parts of one type
    by their blocks; a mix of types or of quantised and dense parts is dequantised first."""
    if not any(isinstance(p, QuantizedWeight) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, QuantizedWeight) for p in parts) and len({(p.qtype, p.in_features) for p in parts}) == 1:
        return QuantizedWeight.cat(parts)
    dtype = next((p.dtype for p in parts), torch.float32)
    return torch.cat([p.dequantize(dtype) if isinstance(p, QuantizedWeight) else p for p in parts])


def checkpoint_quant(ckpt) -> tuple[str, str]:
    """GGUF block types of the decoder linears and of the embedding ('' where dense)."""
    names = {v: k.lower() for k, v in ops.QTYPES.items()}
    qtype = getattr(ckpt, "qtype", lambda name: None)
    layer = next((n for n in sorted(ckpt.names()) if n.endswith("mlp.down_proj.weight")), None)
    embed = "model.embed_tokens.weight"
    q_layer = qtype(layer) if layer else None
    q_embed = qtype(embed) if embed in ckpt.names() else None
    return names.get(q_layer, ""), names.get(q_embed, "")

"""The GGUF block types the quantised linears take (include/stagewise/quant.h): name -> GGML type
id (ggml.h), weights and bytes a block, and the bytes of a 16-row record of the int8 mode's panels
(csrc/cpu/quant_pack.h)."""

from __future__ import annotations

QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
QUANT_BLOCK_WEIGHTS = {2: 32, 3: 32, 8: 32, 12: 256, 14: 256}
"""Weights a block: ``in_features`` must be a multiple."""
QUANT_BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 12: 144, 14: 210}
QUANT_PACK_RECORD_BYTES = {2: 288, 3: 320, 8: 544, 12: 2368, 14: 3360}
"""Bytes of one block of 16 rows in :func:`stagewise.ops.quant_pack_int8`'s panels."""


def quant_row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights in blocks of ``qtype``."""
    return in_features // QUANT_BLOCK_WEIGHTS[qtype] * QUANT_BLOCK_BYTES[qtype]

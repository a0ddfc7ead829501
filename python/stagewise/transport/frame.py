"""What a frame holds (seed 000 §3): the enums of the header, the row table, the ``Frame`` dataclass.

The byte layout lives in :mod:`stagewise.transport.codec` and ``docs/wire-format.md``; this
module only describes the content, and the rule that derives the header's shape fields from
the primary tensor (the first entry of ``Frame.tensors``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

MAGIC = b"SWFR"
VERSION = 1
MAX_NDIM = 8
"""Most dimensions of one tensor (a KV block table [layers, blocks, block_size, heads, dim] needs 5)."""
MAX_NAME_BYTES = 24
"""Longest tensor name, in UTF-8 bytes."""
MAX_TENSORS = 64
MAX_ROWS = 1 << 20
MAX_CONTROL_BYTES = 16 << 20
DEFAULT_MAX_PAYLOAD_BYTES = 2 << 30
"""Tensor bytes one frame may carry unless the receiver says otherwise (a long request's KV handoff
for one stage can reach a gigabyte)."""


class StepKind(enum.IntEnum):
    PREFILL = 1
    DECODE = 2
    MIXED = 3
    """A batched step with both prefill chunks and decode rows (the row table tells which)."""
    TOKENS = 4
    """Sampled token ids, from the last stage back to stage 0."""
    KV_HANDOFF = 5
    """One request's KV for one stage (seed 000 §2.2)."""
    CONTROL = 6
    """Small JSON messages: add-request, cancel, result, shutdown..."""
    HEARTBEAT = 7
    HELLO = 8
    """The first frames of every connection (see :mod:`stagewise.transport.hello`)."""


class WireDType(enum.IntEnum):
    """Element types on the wire; 0 in the header's ``dtype`` means "no tensor"."""

    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT64 = 4
    INT64 = 5
    INT32 = 6
    INT16 = 7
    INT8 = 8
    UINT8 = 9
    BOOL = 10

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> WireDType:
        try:
            return _FROM_TORCH[dtype]
        except KeyError:
            names = ", ".join(str(d).removeprefix("torch.") for d in _FROM_TORCH)
            raise TypeError(f"stagewise.transport: dtype {dtype} cannot go on the wire; expected one of {names}") from None

    def to_torch(self) -> torch.dtype:
        return _TO_TORCH[self]

    @property
    def itemsize(self) -> int:
        return _TO_TORCH[self].itemsize


_TO_TORCH = {
    WireDType.FLOAT32: torch.float32, WireDType.FLOAT16: torch.float16, WireDType.BFLOAT16: torch.bfloat16,
    WireDType.FLOAT64: torch.float64, WireDType.INT64: torch.int64, WireDType.INT32: torch.int32,
    WireDType.INT16: torch.int16, WireDType.INT8: torch.int8, WireDType.UINT8: torch.uint8, WireDType.BOOL: torch.bool,
}  # fmt: skip
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}


class Layout(enum.IntEnum):
    CONTIGUOUS = 1
    """Row-major, no gaps: the only layout v1 sends (seed 000 §3.1)."""


class RowFlags(enum.IntFlag):
    NONE = 0
    PREFILL = 1
    """This row's tokens are (a chunk of) its prompt."""
    LAST_PREFILL_CHUNK = 2
    """The last chunk of the prompt: the last stage samples after it."""
    FINISHED = 4
    """The request is done (EOS, length, stop string): stages free its KV."""
    CANCELLED = 8
    """The request was cancelled: stages free its KV."""
    ERROR = 16
    """The request failed on some stage; the control payload or the result says why."""


@dataclass(slots=True)
class Row:
    """One request's share of a batched step."""

    request_id: int
    """u64."""
    first_position: int
    """Position of the row's first token in its sequence (u32)."""
    num_tokens: int
    """Tokens of this row in the step (u32): the prompt chunk length, or 1 for a decode row."""
    flags: RowFlags = RowFlags.NONE


@dataclass(slots=True)
class Frame:
    """One message between stages. ``batch``, ``seq``, ``hidden_size`` and ``dtype`` are derived
    from the primary tensor (the first of ``tensors``) by :func:`shape_fields` when encoding and
    checked against it when decoding; ``payload_bytes`` and ``checksum`` are filled by the codec."""

    step_kind: StepKind
    request_id: int = 0
    """u64: the request of a single-request frame (batched frames name theirs in ``rows``)."""
    step_id: int = 0
    """u64: the runtime's step / microbatch sequence number."""
    microbatch: int = 0
    """u16: which of the in-flight microbatches this frame belongs to."""
    stage_from: int = 0
    stage_to: int = 0
    token_index: int = 0
    """u32: the current decode position (seed 000 §3.2)."""
    layout: Layout = Layout.CONTIGUOUS
    rows: list[Row] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Named payloads in order, e.g. "hidden", "residual", "token_ids", "positions", "k", "v"."""
    control: dict | None = None
    """JSON object (UTF-8 on the wire) for CONTROL and HELLO frames; allowed on any frame."""
    # Filled by the codec (encode: computed; decode: as read).
    batch: int = 0
    seq: int = 0
    hidden_size: int = 0
    dtype: WireDType | None = None
    payload_bytes: int = 0
    checksum: int = 0
    magic: bytes = MAGIC
    version: int = VERSION

    @property
    def primary(self) -> torch.Tensor | None:
        return next(iter(self.tensors.values()), None)


def shape_fields(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(batch, seq, hidden_size) of a primary tensor of this shape: the last dimension is
    ``hidden_size``, the one before it ``seq``, all earlier ones multiply into ``batch``
    ([b, s, h] -> (b, s, h); [tokens, h] -> (1, tokens, h)). A vector [n] of per-row values
    (token ids) gives (n, 1, 1); a scalar gives (1, 1, 1)."""
    if len(shape) == 0:
        return 1, 1, 1
    if len(shape) == 1:
        return shape[0], 1, 1
    return math.prod(shape[:-2]), shape[-2], shape[-1]

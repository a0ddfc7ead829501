"""What a frame holds: the enums of the header, the row table, the ``Frame`` dataclass.

The byte layout lives in :mod:`stagewise.transport.wire` (the constants), the codec
(:mod:`stagewise.transport.codec`) and ``docs/wire-format.md``; this module only describes the
content, and the rule that derives the header's shape fields from the primary tensor (the first
entry of ``Frame.tensors``). The enums' values are checked against the wire table at import.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from stagewise.transport import wire
from stagewise.transport.wire import (  # noqa: F401  (the limits, where frames are built)
    DEFAULT_MAX_PAYLOAD_BYTES, MAGIC, MAX_CONTROL_BYTES, MAX_NAME_BYTES, MAX_NDIM, MAX_ROWS, MAX_TENSORS, VERSION,
)  # fmt: skip


class StepKind(enum.IntEnum):
    PREFILL = 1
    DECODE = 2
    MIXED = 3
    """A batched step with both prefill chunks and decode rows (the row table tells which)."""
    TOKENS = 4
    """Sampled token ids, from the last stage back to stage 0."""
    KV_HANDOFF = 5
    """One request's KV for one stage."""
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
        return wire.DTYPES[self][1]


_TO_TORCH = {d: getattr(torch, wire.DTYPES[d][0]) for d in WireDType}  # the wire's names are torch's
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}


class Layout(enum.IntEnum):
    CONTIGUOUS = 1
    """Row-major, no gaps: the only layout."""


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
    """u32: the current decode position."""
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


def _check_against_the_wire_table() -> None:
    """The enums above must be the extension's table (include/stagewise/frame.h): an extension
    built from other sources would otherwise encode one thing and decode another."""
    problems = []
    if [int(k) for k in StepKind] != list(range(1, wire.NUM_STEP_KINDS + 1)):
        problems.append(f"step kinds 1..{wire.NUM_STEP_KINDS}")
    if (StepKind.CONTROL, StepKind.HELLO) != (wire.STEP_CONTROL, wire.STEP_HELLO):
        problems.append("the CONTROL and HELLO codes")
    if {int(d): (d.name.lower(), d.itemsize) for d in WireDType} != wire.DTYPES:
        problems.append(f"dtypes {wire.DTYPES}")
    if [int(x) for x in Layout] != [wire.LAYOUT_CONTIGUOUS] or sum(RowFlags) != wire.ROW_FLAG_BITS:
        problems.append("layouts or row flags")
    if problems:
        raise ImportError(f"stagewise.transport.frame: the extension's wire table differs in {'; '.join(problems)}: "
                          "rebuild stagewise._C from these sources (make build)")


_check_against_the_wire_table()

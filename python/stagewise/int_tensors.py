"""Small integer tensors from Python ints, at a fraction of ``torch.tensor``'s cost.

A decode step builds a few tensors of a handful of ints (positions, token ids, slots, lengths)
on every stage, per token. ``torch.tensor(list)`` inspects every element to infer a type and
costs ~10-15 us per call on a small CPU even with warm caches; the ints packed into an
``array.array`` and wrapped by ``torch.frombuffer`` (which keeps the array alive) cost ~3 us.
"""

from __future__ import annotations

import array
from collections.abc import Iterable

import torch

_CODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: Iterable[int], dtype: torch.dtype = torch.int64,
               device: torch.device | str | None = None) -> torch.Tensor:
    """A 1-D ``dtype`` (int64 or int32) tensor of ``values`` on ``device`` (default: the CPU).
    OverflowError for a value that does not fit ``dtype``."""
    code = _CODES.get(dtype)
    if code is None:
        raise ValueError(f"int_tensor: dtype must be torch.int64 or torch.int32, got {dtype}")
    packed = array.array(code, values)
    t = torch.frombuffer(packed, dtype=dtype) if packed else torch.empty(0, dtype=dtype)
    return t if device is None or torch.device(device).type == "cpu" else t.to(device)

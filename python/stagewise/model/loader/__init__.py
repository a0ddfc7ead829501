# Interim bridge on this branch only; replaced when the model restructuring is merged.
from __future__ import annotations

import torch

from stagewise.model.checkpoint import Checkpoint, open_checkpoint
from stagewise.model.weights import DTYPES, load_stage_weights


def resolve_dtype(dtype, stated):
    if dtype == "auto":
        return stated if stated in DTYPES.values() else torch.float32
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return dtype


__all__ = ["DTYPES", "Checkpoint", "load_stage_weights", "open_checkpoint", "resolve_dtype"]

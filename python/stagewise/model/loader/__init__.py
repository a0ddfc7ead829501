"""Loading a stage's weights: checkpoint formats (HF safetensors folders, GGUF files, the embedded
default model), the mapping of the checkpoint's tensors onto the table of
:mod:`stagewise.model.shapes`, and the one place that cuts a tensor for a tensor-parallel rank."""

from stagewise.model.loader.checkpoint import Checkpoint
from stagewise.model.loader.sources import open_checkpoint
from stagewise.model.loader.stage_weights import DTYPES, load_stage_weights, resolve_device, resolve_dtype

__all__ = ["DTYPES", "Checkpoint", "load_stage_weights", "open_checkpoint", "resolve_device", "resolve_dtype"]

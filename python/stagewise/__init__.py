"""stagewise: one large language model across several GPUs, processes and machines."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stagewise.version import __version__
__all__ = ["Completion", "FrameError", "Pipeline", "__version__"]

if TYPE_CHECKING:
    from stagewise.api import Completion, Pipeline
    from stagewise.transport.errors import FrameError


def __getattr__(name: str):
    # Loaded on first use, so that `import stagewise` stays light (no torch, no extension).
    if name in ("Pipeline", "Completion"):
        from stagewise import api

        return getattr(api, name)
    if name == "FrameError":
        from stagewise.transport.errors import FrameError

        return FrameError
    raise AttributeError(f"module 'stagewise' has no attribute {name!r}")

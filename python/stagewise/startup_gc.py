"""The cyclic garbage collector while a command starts.

Importing torch and loading a model create about a million long-lived Python objects; each full
pass of the collector walks all of them, and start-up triggers several (~0.1 s each here), all
before a command's first token. A command that starts a model (``generate``, ``serve``, a stage
process) therefore pauses the collector from its first line, and once the model is loaded
:func:`settle` freezes what start-up left — modules, weights, the model: it lives as long as the
process, so later passes skip it (they stay short while a server runs) — and resumes collecting.
The library (:class:`stagewise.Pipeline` in a user's process) leaves the collector alone.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Stop collecting until :func:`settle` (a no-op when collection is already off)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def settle() -> None:
    """Start-up is over: move every object alive now out of the collector's reach and collect
    again, if :func:`pause` stopped it. Safe to call more than once, and without :func:`pause`."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False

"""What can go wrong with a pipeline's stages, as the driver sees them: the processes it watches
(:class:`StageProcesses`, whatever launcher started them), the kinds of failure (:class:`Fault`)
and the error a broken pipeline raises (:class:`PipelineBroken`)."""

from __future__ import annotations

import enum
from typing import Protocol


class StageProcesses(Protocol):
    """The processes of the stages, as their launcher sees them (local children, ssh clients)."""

    def exit_code(self, stage: int) -> int | None:
        """None while stage's process runs; its exit code (negative: killed by that signal)."""

    def failure(self, stage: int) -> str | None:
        """What an exited stage said of its failure (its own words), if it said anything."""

    def stop(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for every process to exit, then terminate, then kill."""


class PipelineBroken(RuntimeError):
    """A stage died, hung or disconnected; the pipeline cannot serve any more."""


class Fault(enum.IntEnum):
    """What went wrong with a stage, most telling first: when several stages report, the pipeline
    is said to have failed of the lowest."""

    KILLED = 0
    """The process died of a signal, or went silent (hung or unreachable)."""
    FAILED = 1
    """The stage failed on its own (it reported the error)."""
    LOST_NEIGHBOUR = 2
    """The stage only lost a neighbour."""
    GONE = 3
    """The process exited or closed its connection."""

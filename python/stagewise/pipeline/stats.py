"""What a stage measures of itself: time computing, sending and waiting, bytes moved, and a
timeline of spans for a Chrome trace."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from stagewise.pipeline.messages import Stats

MAX_TRACE_EVENTS = 200_000


@dataclass(slots=True)
class StageStats:
    busy_s: float = 0.0
    send_s: float = 0.0
    recv_wait_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rejected_frames: int = 0
    started_s: float = field(default_factory=time.perf_counter)
    trace: list[tuple[str, float, float, int]] = field(default_factory=list)
    """(name, start, duration, microbatch): name is compute, send or recv-wait; start is
    ``time.perf_counter()`` (CLOCK_MONOTONIC: one time base for all processes of a host)."""

    def reset(self) -> None:
        """Start counting afresh (the same object: the head or worker keeps its reference)."""
        fresh = StageStats()
        for name in self.__slots__:
            setattr(self, name, getattr(fresh, name))

    def event(self, name: str, start: float, end: float, microbatch: int = -1) -> None:
        if len(self.trace) < MAX_TRACE_EVENTS:
            self.trace.append((name, start, end - start, microbatch))

    def computed(self, start: float, end: float, tokens: int, microbatch: int) -> None:
        """One step of ``tokens`` tokens computed between ``start`` and ``end``."""
        self.busy_s += end - start
        self.steps += 1
        self.tokens += tokens
        self.event("compute", start, end, microbatch)

    def report(self, stage: int, layers: tuple[int, int], *, trace: bool) -> Stats:
        return Stats(stage=stage, layers=layers, busy_s=self.busy_s, send_s=self.send_s,
                     recv_wait_s=self.recv_wait_s, steps=self.steps, tokens=self.tokens, bytes_sent=self.bytes_sent,
                     bytes_received=self.bytes_received, rejected_frames=self.rejected_frames,
                     wall_s=time.perf_counter() - self.started_s, trace=list(self.trace) if trace else None)

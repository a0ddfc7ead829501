"""Pipeline timelines in Chrome-trace format (opens in Perfetto and chrome://tracing), shared by
the planner's predicted timeline (``stagewise plan --trace``) and the runtime's measured one.

Schema (the JSON Object Format of the Trace Event spec):

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}

- one process per timeline (``pid``; ``process_name`` metadata says e.g. "predicted" or
  "measured"), so a predicted and a measured trace loaded together sit one above the other;
- one track per pipeline stage (``tid`` = stage index; ``thread_name`` metadata "stage i");
- complete events (``"ph": "X"``) with ``ts`` and ``dur`` in microseconds, ``cat`` one of
  :data:`CATEGORIES` and ``name`` e.g. "prefill mb0", "send mb0 -> 1", "bubble";
- ``args`` free-form details (microbatch, step, bytes, flops);
- ``otherData`` what the timeline describes (model, layout, profile, units).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CATEGORIES = ("compute", "comm", "bubble")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """A span on one stage's track; times in seconds from the timeline's start."""

    stage: int
    name: str
    cat: str
    start_s: float
    dur_s: float
    args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cat not in CATEGORIES:
            raise ValueError(f"TraceEvent.cat: expected one of {CATEGORIES}, got {self.cat!r}")
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage < 0:
            raise ValueError(f"TraceEvent.stage: expected an int >= 0, got {self.stage!r}")
        if not (self.start_s >= 0 and self.dur_s >= 0):
            raise ValueError(f"TraceEvent: start_s and dur_s must be >= 0, got {self.start_s}, {self.dur_s}")


def chrome_trace(events: Iterable[TraceEvent], *, num_stages: int, process: str = "predicted", pid: int = 0,
                 other: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The trace as a dict (see the module docstring)."""
    out: list[dict[str, Any]] = [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
                                  "args": {"name": process}}]
    for s in range(num_stages):
        out.append({"ph": "M", "pid": pid, "tid": s, "name": "thread_name", "args": {"name": f"stage {s}"}})
        out.append({"ph": "M", "pid": pid, "tid": s, "name": "thread_sort_index", "args": {"sort_index": s}})
    for e in events:
        if e.stage >= num_stages:
            raise ValueError(f"chrome_trace: event {e.name!r} is on stage {e.stage}, but there are {num_stages}")
        out.append({"ph": "X", "pid": pid, "tid": e.stage, "name": e.name, "cat": e.cat,
                    "ts": round(e.start_s * 1e6, 3), "dur": round(e.dur_s * 1e6, 3), "args": dict(e.args)})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": dict(other or {})}


def write_chrome_trace(path: str | Path, events: Iterable[TraceEvent], *, num_stages: int,
                       process: str = "predicted", pid: int = 0, other: Mapping[str, Any] | None = None) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events, num_stages=num_stages, process=process, pid=pid,
                                            other=other), indent=1) + "\n")
    return path


def read_chrome_trace(path: str | Path) -> list[TraceEvent]:
    """The complete events of a trace written by :func:`write_chrome_trace` (metadata dropped)."""
    data = json.loads(Path(path).read_text())
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"chrome trace {str(path)!r}: expected an object with a 'traceEvents' list")
    return [TraceEvent(e["tid"], e["name"], e["cat"], e["ts"] / 1e6, e["dur"] / 1e6, e.get("args", {}))
            for e in events if e.get("ph") == "X"]


def write_stage_trace(path, stages: list[dict], plan) -> None:
    """The measured timeline of a pipeline's stages (``Pipeline.stage_stats(trace=True)``) as a
    Chrome trace: one track per stage with compute, send and receive-wait spans."""
    spans = [(s["stage"], *e) for s in stages for e in s["trace"] or []]
    t0 = min((start for _, _, start, _, _ in spans), default=0.0)
    kinds = {"compute": "compute", "send": "comm", "recv-wait": "bubble"}
    events = [TraceEvent(stage, f"{name} mb{mb}" if mb >= 0 else name, kinds[name], start - t0, dur,
                         {"microbatch": mb}) for stage, name, start, dur, mb in spans]
    write_chrome_trace(path, events, num_stages=len(stages), process="measured",
                       other={"model": plan.model, "layers": str(plan.stage_plan), "transport": plan.transport})

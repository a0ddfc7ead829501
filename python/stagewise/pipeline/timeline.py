"""Where one decode token's time goes on its way through the pipeline, from the spans every stage
records of itself (:class:`~stagewise.pipeline.roles.StageStats`: compute, send and recv-wait, on
one clock for all processes of a host).

With one request in flight, stage 0's compute spans follow one another a token apart. Between two
of them the token crosses every stage and comes back; :func:`token_segments` cuts that cycle into
consecutive segments, each the median over the tokens:

- ``stage i compute``: the step through the stage's layers (stage 0: its scheduling too; the last
  stage: its sampling too);
- ``stage i compute -> send``: turning the result into a frame (stage 0: also the step's metadata);
- ``stage i send``: writing the frame to the link;
- ``hop i -> j``: from the end of the send to the end of the receiver's wait: the link, and the
  receiver waking up (negative when the receiver had the frame before the sender's call returned);
- ``stage j recv -> compute``: decoding the frame and checking the step before the layers run;
- ``stage 0 recv -> next compute``: recording the token and scheduling the next step.

The segments add up to the cycle; what is not compute is what the pipeline adds to the layers.
"""

from __future__ import annotations

import bisect
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_COMPUTE = re.compile(r"stage \d+ compute")


@dataclass(frozen=True, slots=True)
class TokenTimeline:
    cycle_us: float
    """Median time from one stage-0 compute to the next."""
    segments: list[tuple[str, float]]
    """Each segment's median microseconds, in the order a token meets them."""
    tokens: int
    """Cycles measured."""

    @property
    def overhead_us(self) -> float:
        """The segments that are not a stage's compute: what the pipeline adds to the layers."""
        return sum(us for name, us in self.segments if not _COMPUTE.fullmatch(name))


def median_timeline(runs: Sequence[TokenTimeline]) -> TokenTimeline:
    """Each segment's and the cycle's median over several runs of the same layout."""
    names = list(dict.fromkeys(name for r in runs for name, _ in r.segments))
    return TokenTimeline(cycle_us=statistics.median(r.cycle_us for r in runs), tokens=sum(r.tokens for r in runs),
                         segments=[(n, statistics.median(dict(r.segments)[n] for r in runs if n in dict(r.segments)))
                                   for n in names])


def token_segments(stages: Sequence[Mapping[str, Any]]) -> TokenTimeline:
    """The cycle of a batch-1 decode token through ``stages`` (each stage's stats with its ``trace``
    of ``(name, start_s, dur_s, microbatch)`` spans, as ``Pipeline.stage_stats(trace=True)`` gives
    them). The first compute of stage 0 (the prefill) starts no cycle. ValueError when the spans do
    not hold two decode cycles."""
    spans = [{} for _ in stages]
    for i, s in enumerate(stages):
        for name, start, dur, _ in s.get("trace") or ():
            spans[i].setdefault(name, []).append((start, start + dur))
    for kinds in spans:
        for v in kinds.values():
            v.sort()
    head = spans[0].get("compute", [])
    if len(head) < 3:
        raise ValueError(f"token_segments: stage 0 has {len(head)} compute spans; a prefill and two decode steps "
                         "are needed (was the trace on, with one request?)")
    parts: dict[str, list[float]] = {}
    cycles = []
    for a, b in zip(head[1:], head[2:]):
        marks = _cycle(spans, a, b)
        if marks is None:
            continue
        cycles.append(b[0] - a[0])
        for name, us in marks:
            parts.setdefault(name, []).append(us)
    if not cycles:
        raise ValueError("token_segments: no decode step went through every stage between two of stage 0's")
    order = list(parts)
    return TokenTimeline(cycle_us=1e6 * statistics.median(cycles), tokens=len(cycles),
                         segments=[(name, 1e6 * statistics.median(parts[name])) for name in order])


def _cycle(spans: list[dict], a: tuple[float, float], b: tuple[float, float]) -> list[tuple[str, float]] | None:
    """The segments between stage 0's computes ``a`` and ``b`` (None: a span is missing)."""
    n, t = len(spans), a[1]
    marks = [("stage 0 compute", a[1] - a[0])]
    sent = None  # the last send: its receiver's wait ends after it began (maybe before it returned)
    for i in range(n):
        if i > 0:
            wait = _first(spans[i].get("recv-wait"), sent[0], end=True)
            compute = wait and _first(spans[i].get("compute"), wait[1])
            if not compute or compute[1] > b[0]:
                return None
            marks += [(f"hop {i - 1} -> {i}", wait[1] - t), (f"stage {i} recv -> compute", compute[0] - wait[1]),
                      (f"stage {i} compute", compute[1] - compute[0])]
            t = compute[1]
        sent = _first(spans[i].get("send"), t)
        if not sent or sent[0] > b[0]:
            return None
        marks += [(f"stage {i} compute -> send", sent[0] - t), (f"stage {i} send", sent[1] - sent[0])]
        t = sent[1]
    back = _first(spans[0].get("recv-wait"), sent[0], end=True)
    if not back or back[1] > b[0]:
        return None
    marks += [(f"hop {n - 1} -> 0", back[1] - t), ("stage 0 recv -> next compute", b[0] - back[1])]
    return marks


def _first(spans: list[tuple[float, float]] | None, t: float, *, end: bool = False) -> tuple[float, float] | None:
    """The first span starting (``end``: ending) at or after ``t``."""
    if not spans:
        return None
    i = bisect.bisect_left(spans, t, key=(lambda s: s[1]) if end else (lambda s: s[0]))
    return spans[i] if i < len(spans) else None


def format_segments(timelines: Mapping[int, TokenTimeline], base_tpot_us: float | None = None) -> str:
    """A markdown table: one column per stage count, a row per segment (µs per token)."""
    counts = sorted(timelines)
    names = sorted(dict.fromkeys(name for s in counts for name, _ in timelines[s].segments), key=_place)
    lines = ["| segment (µs per token) | " + " | ".join(f"S = {s}" for s in counts) + " |",
             "|---|" + "---:|" * len(counts)]
    for name in names:
        cells = [dict(timelines[s].segments).get(name) for s in counts]
        lines.append(f"| {name} | " + " | ".join("-" if c is None else f"{c:.0f}" for c in cells) + " |")
    lines.append("| **cycle (one token)** | " + " | ".join(f"{timelines[s].cycle_us:.0f}" for s in counts) + " |")
    lines.append("| sum of the segments not compute | " + " | ".join(
        f"{timelines[s].overhead_us:.0f}" for s in counts) + " |")
    if base_tpot_us is not None:
        lines.append(f"| cycle - TPOT of S = 1 ({base_tpot_us:.0f}) | " + " | ".join(
            f"{timelines[s].cycle_us - base_tpot_us:+.0f}" for s in counts) + " |")
    return "\n".join(lines)


def _place(name: str) -> tuple[float, int, str]:
    """Where a segment comes in a token's way through any number of stages."""
    words = name.split()
    if name == "stage 0 recv -> next compute":
        return float("inf"), 0, name
    if words[0] == "hop":
        return int(words[1]), 5, name
    stage = int(words[1])
    phase = {"recv": 1, "compute": 2 if len(words) == 3 else 3, "send": 4}[words[2]]
    return stage, phase, name

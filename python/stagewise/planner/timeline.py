"""The predicted pipeline timeline of one phase: events per stage (compute, comm, bubble), as a
Chrome trace (:mod:`stagewise.trace`) or a PNG picture; :func:`write_pictures` draws a layout's
prefill and first decode steps for ``stagewise plan --plot/--trace``.

Schedule (fill-drain): microbatch ``j`` runs on stage ``i`` after it left stage ``i - 1`` and
after microbatch ``j - 1`` left stage ``i``; on a stage it receives, computes and sends (the hops'
time is part of the stage time). With equal microbatches the
makespan is exactly ``sum(stage_times) + (m - 1) * max(stage_times)``. Bubble events fill each
stage's idle time inside that span.

The PNG is drawn without a plotting library (a few rectangles and a 5x7 bitmap font, written
with zlib): the picture needs nothing beyond the standard library, so ``--plot`` always works.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from stagewise.planner.estimate import PhaseEstimate
from stagewise.trace import TraceEvent, write_chrome_trace


def phase_events(phase: PhaseEstimate, label: str, offset_s: float = 0.0) -> list[TraceEvent]:
    est = phase.pipeline
    S, m = len(est.stage_times_s), est.num_microbatches
    ins_outs = est.stage_comm_in_out_s or tuple((0.0, c) for c in est.stage_comm_times_s)
    end = [[0.0] * m for _ in range(S)]
    events: list[TraceEvent] = []
    busy: list[list[tuple[float, float]]] = [[] for _ in range(S)]
    for i in range(S):
        t_in, t_out = ins_outs[i]
        for j in range(m):
            start = max(end[i - 1][j] if i else 0.0, end[i][j - 1] if j else 0.0)
            t = start
            if t_in > 0:
                events.append(TraceEvent(i, f"recv mb{j} <- {i - 1}", "comm", offset_s + t, t_in,
                                         {"microbatch": j, "phase": label}))
                t += t_in
            events.append(TraceEvent(i, f"{label} mb{j}", "compute", offset_s + t, est.stage_compute_times_s[i],
                                     {"microbatch": j, "phase": label, "rows": phase.rows_per_microbatch,
                                      "new_tokens": phase.new_tokens, "context": phase.context}))
            t += est.stage_compute_times_s[i]
            if t_out > 0:
                events.append(TraceEvent(i, f"send mb{j} -> {(i + 1) % S}", "comm", offset_s + t, t_out,
                                         {"microbatch": j, "phase": label}))
                t += t_out
            end[i][j] = t
            busy[i].append((start, t))
    span = est.latency_s
    for i in range(S):
        cursor = 0.0
        for a, b in busy[i] + [(span, span)]:
            if a - cursor > span * 1e-9:
                events.append(TraceEvent(i, "bubble", "bubble", offset_s + cursor, a - cursor, {"phase": label}))
            cursor = max(cursor, b)
    return events


# --- PNG -------------------------------------------------------------------------------------

_FONT = {  # 5x7 glyphs, one int per row, bit 4 = leftmost column
    "0": (14, 17, 19, 21, 25, 17, 14), "1": (4, 12, 4, 4, 4, 4, 14), "2": (14, 17, 1, 2, 4, 8, 31),
    "3": (31, 2, 4, 2, 1, 17, 14), "4": (2, 6, 10, 18, 31, 2, 2), "5": (31, 16, 30, 1, 1, 17, 14),
    "6": (6, 8, 16, 30, 17, 17, 14), "7": (31, 1, 2, 4, 8, 8, 8), "8": (14, 17, 17, 14, 17, 17, 14),
    "9": (14, 17, 17, 15, 1, 2, 12), "A": (14, 17, 17, 31, 17, 17, 17), "B": (30, 17, 17, 30, 17, 17, 30),
    "C": (14, 17, 16, 16, 16, 17, 14), "D": (28, 18, 17, 17, 17, 18, 28), "E": (31, 16, 16, 30, 16, 16, 31),
    "F": (31, 16, 16, 30, 16, 16, 16), "G": (14, 17, 16, 23, 17, 17, 15), "H": (17, 17, 17, 31, 17, 17, 17),
    "I": (14, 4, 4, 4, 4, 4, 14), "J": (7, 2, 2, 2, 2, 18, 12), "K": (17, 18, 20, 24, 20, 18, 17),
    "L": (16, 16, 16, 16, 16, 16, 31), "M": (17, 27, 21, 21, 17, 17, 17), "N": (17, 17, 25, 21, 19, 17, 17),
    "O": (14, 17, 17, 17, 17, 17, 14), "P": (30, 17, 17, 30, 16, 16, 16), "Q": (14, 17, 17, 17, 21, 18, 13),
    "R": (30, 17, 17, 30, 20, 18, 17), "S": (15, 16, 16, 14, 1, 1, 30), "T": (31, 4, 4, 4, 4, 4, 4),
    "U": (17, 17, 17, 17, 17, 17, 14), "V": (17, 17, 17, 17, 17, 10, 4), "W": (17, 17, 17, 21, 21, 21, 10),
    "X": (17, 17, 10, 4, 10, 17, 17), "Y": (17, 17, 10, 4, 4, 4, 4), "Z": (31, 1, 2, 4, 8, 16, 31),
    " ": (0,) * 7, ".": (0, 0, 0, 0, 0, 12, 12), ":": (0, 12, 12, 0, 12, 12, 0), "=": (0, 0, 31, 0, 31, 0, 0),
    "-": (0, 0, 0, 31, 0, 0, 0), "|": (4,) * 7, "(": (2, 4, 8, 8, 8, 4, 2), ")": (8, 4, 2, 2, 2, 4, 8),
    "%": (24, 25, 2, 4, 8, 19, 3), "/": (0, 1, 2, 4, 8, 16, 0), ",": (0, 0, 0, 0, 12, 4, 8),
    "+": (0, 4, 4, 31, 4, 4, 0), "_": (0, 0, 0, 0, 0, 0, 31), ">": (8, 4, 2, 1, 2, 4, 8), "<": (2, 4, 8, 16, 8, 4, 2),
}
COLORS = {"compute": (66, 133, 244), "comm": (244, 160, 0), "bubble": (230, 230, 230), "prefill": (52, 168, 83)}


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.w, self.h = width, height
        self.px = bytearray(b"\xff" * (width * height * 3))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.w, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.h, max(y0, y1))
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            o = (y * self.w + x0) * 3
            self.px[o:o + len(row)] = row

    def text(self, x: int, y: int, s: str, color: tuple[int, int, int] = (0, 0, 0), scale: int = 2) -> None:
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT[" "])
            for r, bits in enumerate(glyph):
                for c in range(5):
                    if bits >> (4 - c) & 1:
                        self.rect(x + c * scale, y + r * scale, x + (c + 1) * scale, y + (r + 1) * scale, color)
            x += 6 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def write_png(path: str | Path, events: list[TraceEvent], *, num_stages: int, title: str, width: int = 1200) -> Path:
    """Stages as rows, time left to right: compute blue (prefill green), comm orange, bubble grey."""
    left, top, lane, gap = 130, 60, 40, 10
    height = top + num_stages * (lane + gap) + 70
    span = max((e.start_s + e.dur_s for e in events), default=0.0) or 1.0
    c = _Canvas(width, height)
    plot_w = width - left - 30
    c.text(10, 12, title[: (width - 20) // 12])
    for s in range(num_stages):
        y = top + s * (lane + gap)
        c.text(10, y + lane // 2 - 7, f"stage {s}")
        c.rect(left, y, left + plot_w, y + lane, (245, 245, 245))
    for e in events:
        y = top + e.stage * (lane + gap)
        x0 = left + int(e.start_s / span * plot_w)
        x1 = left + max(int((e.start_s + e.dur_s) / span * plot_w), x0 + 1)
        color = COLORS["prefill"] if e.cat == "compute" and str(e.args.get("phase")) == "prefill" else COLORS[e.cat]
        c.rect(x0, y + 2, x1, y + lane - 2, color)
        if e.cat == "compute" and x1 > x0 + 1:
            c.rect(x1 - 1, y + 2, x1, y + lane - 2, (255, 255, 255))  # separate adjacent microbatches
    axis_y = top + num_stages * (lane + gap)
    c.rect(left, axis_y, left + plot_w, axis_y + 2, (0, 0, 0))
    unit, scale = ("ms", 1e3) if span < 10 else ("s", 1.0)
    for k in range(6):
        x = left + k * plot_w // 5
        c.rect(x, axis_y, x + 2, axis_y + 8, (0, 0, 0))
        c.text(min(x - 10, width - 110), axis_y + 12, f"{span * k / 5 * scale:.3g} {unit}")
    lx = left
    for name in ("prefill", "decode", "comm", "bubble"):
        c.rect(lx, height - 22, lx + 16, height - 8, COLORS["compute" if name == "decode" else name])
        c.text(lx + 22, height - 22, name)
        lx += 40 + 12 * len(name)
    path = Path(path)
    path.write_bytes(c.png())
    return path


def layout_events(est, decode_steps: int = 4) -> list[TraceEvent]:
    """A layout's prefill, then ``decode_steps`` decode steps, on one timeline."""
    events = phase_events(est.prefill, "prefill")
    t = est.prefill.pipeline.latency_s
    for k in range(decode_steps):
        step = phase_events(est.decode, f"decode{k}", t)
        events += step
        # Each step drawn as one pass from idle (its groups may overrun the steady-state step time).
        t = max(t + est.decode.pipeline.latency_s, max(e.start_s + e.dur_s for e in step))
    return events


def write_pictures(est, name: str, profile, *, plot: Path | None, trace: Path | None) -> list[str]:
    """``stagewise plan --plot/--trace``: the best layout's timeline as a PNG and a Chrome trace;
    the files written."""
    written: list[str] = []
    if not (plot or trace):
        return written
    events = layout_events(est)
    title = f"{name} {est.layout.label()} on {profile.name}: prefill then decode steps"
    if trace:
        write_chrome_trace(trace, events, num_stages=est.plan.num_stages, process="predicted",
                           other={"model": name, "parallel": est.layout.label(), "profile": profile.name,
                                  "stage_ranges": est.plan.ranges, "units": "seconds in args, us in ts/dur"})
        written.append(str(trace))
    if plot:
        write_png(plot, events, num_stages=est.plan.num_stages, title=title)
        written.append(str(plot))
    return written

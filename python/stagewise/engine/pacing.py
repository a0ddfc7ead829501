"""A time-per-output-token target for the running requests (:class:`TpotPacer`).

Continuous batching runs new prompts in the same steps as the running requests' decodes, so
every prompt that arrives slows the tokens of every request already streaming: a 300-token
prompt in a step makes that step many times longer than a decode step, and every row it adds
makes each later step longer. With a target, stage 0 gives new prompts only what the running
requests can spare:

- **Prompt tokens.** A request with ``k`` tokens, the first at ``t0``, keeps its mean time per
  output token within the target after a step that ends at ``T`` when ``T - t0 <= target * k``.
  A step's prompt tokens get the least of that slack over the decoding requests, less the step's
  decode time, at the measured cost per prompt token. Prompts that do not fit are prefilled in
  chunks over the following steps (chunked prefill), as the requests gain slack with every token
  that comes faster than the target.
- **Rows.** A new request joins only while a decode step of every running row and the new ones
  stays within the target.

The costs are fitted on this stage's own recent steps, so they follow the batch, the threads and
the machine: a decode step of ``r`` rows takes ``a + b * r``; a step's ``n`` prompt tokens add
``fixed + per_token * n`` (``fixed``: the layer loop a step with a prompt takes instead of the
decode loop), on the steps that ran prompt tokens beside decodes. Each is a least-squares line
through a window of steps. Before any decode step was
timed the pacer limits nothing; the first prompt beside decodes runs a small chunk, which prices
the ones after it. The prompt cost errs high: its line is raised until 90 % of the recent steps
lie under it (a step's fixed cost is not quite a constant), and a step beside decodes runs at least
:data:`MIN_CHUNK` prompt tokens or none.

A target that even one decode row cannot keep is still served: a request then starts only when
nothing runs, one after another.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

UNLIMITED = 1 << 30
MIN_CHUNK = 16
"""The fewest prompt tokens a step beside decodes runs (the first such step prices the ones after
it): a step with prompt tokens pays the layer loop's fixed cost, which a few tokens would waste."""


def _floor(x: float) -> int:
    """``x`` rounded down, a rounding error below a whole number counted as that number."""
    return math.floor(x + 1e-9)


class CostLine:
    """A least-squares line ``y = a + b * x`` through the last ``window`` points (b >= 0)."""

    def __init__(self, window: int) -> None:
        self.points: deque[tuple[float, float]] = deque(maxlen=window)
        self._fits: dict[float | None, tuple[float, float] | None] = {}
        """fit(upper) since the last point: asked for every step, changed only by a new point."""

    def add(self, x: float, y: float) -> None:
        self.points.append((x, y))
        self._fits.clear()

    def fit(self, upper: float | None = None) -> tuple[float, float] | None:
        """(a, b), or None before any point; b is 0 while every point has the same x. With
        ``upper`` (a share, e.g. 0.9), ``a`` is raised so that that share of the points lies on or
        under the line: where the costs are not quite a line, the pacer's estimate errs high."""
        if upper not in self._fits:
            self._fits[upper] = self._fit(upper)
        return self._fits[upper]

    def _fit(self, upper: float | None) -> tuple[float, float] | None:
        pts = self.points
        if not pts:
            return None
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        var = sum((x - mx) ** 2 for x, _ in pts)
        slope = max(sum((x - mx) * (y - my) for x, y in pts) / var if var > 0 else 0.0, 0.0)
        a = my - slope * mx
        if upper is not None:
            above = sorted(y - (a + slope * x) for x, y in pts)
            a += max(above[max(math.ceil(upper * n) - 1, 0)], 0.0)
        return a, slope


@dataclass(frozen=True, slots=True)
class Budget:
    """What the next step may start: ``tokens`` prompt tokens, ``rows`` new requests."""

    tokens: int
    rows: int


class TpotPacer:
    """Prompt tokens and new rows the next step may take, for a target time per output token."""

    def __init__(self, target_s: float, *, window: int = 64) -> None:
        if isinstance(target_s, bool) or not isinstance(target_s, (int, float)) or not 0 < target_s < math.inf:
            raise ValueError(f"TpotPacer: the target time per output token must be > 0 seconds, got {target_s!r}")
        self.target_s = float(target_s)
        self._decode = CostLine(window)
        """seconds of a step without prompt tokens, by its rows."""
        self._prefill = CostLine(window)
        """seconds a step's prompt tokens add to its decode time, by the tokens."""
        self._started: dict[int, tuple[float, int, int, bool]] = {}
        """group -> (start time, rows, prompt tokens, whether some rows decode) of its step in flight."""
        self._ended: dict[int, float] = {}
        """group -> when its last step came back."""
        self.between_s = 0.0
        """Running mean of the time from a step's tokens to the next step of its group while
        requests decode (streaming the tokens, taking new requests): part of every token's time."""

    # ---- what the steps cost -------------------------------------------------------------

    def started(self, group: int, rows: int, prompt_tokens: int, now: float, *, decoding: bool = True) -> None:
        """A step of ``rows`` rows (decoding or prefilling) and ``prompt_tokens`` prompt tokens;
        ``decoding``: some of its rows decode. Prompt tokens are priced on such steps only, the
        ones a budget is for: a step of prompts alone (nothing streams, no budget) may be a long
        prompt whose attention grows with its square, which a line through it would price wrongly
        for every short chunk after it."""
        self._started[group] = (now, rows, prompt_tokens, decoding)

    def ended(self, group: int, now: float | None) -> None:
        """The step of ``group`` came back (its tokens were recorded at ``now``; None: it failed,
        and prices nothing)."""
        start = self._started.pop(group, None)
        if now is None:
            self._ended.pop(group, None)
            return
        self._ended[group] = now
        if start is None:
            return
        began, rows, tokens, decoding = start
        seconds = now - began
        if tokens == 0:
            self._decode.add(rows, seconds)
        elif decoding and (decode := self.decode_s(rows)) is not None:
            self._prefill.add(tokens, max(seconds - decode, 0.0))

    def decode_s(self, rows: int) -> float | None:
        """A decode step of ``rows`` rows, as measured (None before any)."""
        line = self._decode.fit()
        return None if line is None else line[0] + line[1] * rows

    # ---- the next step -------------------------------------------------------------------

    def budget(self, group: int, clocks: Iterable[tuple[float, int]], rows: int, waiting: int,
               now: float) -> Budget | None:
        """What the next step of ``group`` may start, given each decoding request's (time of its
        first token, tokens so far; of every group: a long step of one group holds up the others'
        on every stage), the group's rows running now (decoding or prefilling) and its requests
        waiting to start; None: no limit (nothing measured yet)."""
        clocks = list(clocks)
        last = self._ended.pop(group, None)  # once: a group asked again without a step between is idle
        if clocks and last is not None:
            self.between_s = 0.8 * self.between_s + 0.2 * (now - last)
        decode = self._decode.fit()
        if decode is None:
            return None
        a, b = decode
        a += self.between_s
        if b > 0:
            most = _floor((self.target_s - a) / b)
        else:  # every step timed had the same rows: try one more row than that, when it keeps the target
            most = int(max(x for x, _ in self._decode.points)) + 1 if a < self.target_s else 0
        new_rows = max(most - rows, 0)
        if not clocks:
            # Nothing streams: prompts run at once. With nothing running at all, at least one starts.
            return Budget(UNLIMITED, new_rows if rows else max(new_rows, 1))
        prefill = self._prefill.fit(upper=0.9)
        if prefill is None:
            return Budget(MIN_CHUNK, min(new_rows, 1))  # price prompt tokens on a small chunk first
        fixed, per_token = prefill
        if per_token == 0:  # one chunk length priced so far: all of its cost per token (0: it cost nothing)
            fixed, per_token = 0.0, max(y / x for x, y in self._prefill.points)
        # The step's decode time with every row it may start (each adds ``b`` to it) and the
        # layer loop of a step with prompt tokens; what is left of the tightest request's slack
        # buys prompt tokens.
        slack = (min(self.target_s * k - (now - t0) for t0, k in clocks)
                 - (a + b * (rows + min(new_rows, waiting))) - fixed)
        tokens = 0 if slack <= 0 else UNLIMITED if per_token == 0 else _floor(slack / per_token)
        return Budget(tokens, new_rows) if tokens >= MIN_CHUNK else Budget(0, 0)

"""Timers: warm-up, then the median of N timed calls; and the copy- and read-bandwidth ceilings.

CPU calls are timed with ``time.perf_counter`` around each call (the ops are
synchronous there). CUDA calls are timed with a pair of CUDA events around each
call, after a ``torch.cuda.synchronize``; before each timed call the L2 cache
is flushed by overwriting a buffer larger than it, outside the timed interval,
so that small cases are not measured from a cache the previous call warmed.
On CPU no flush is done (it would cost more than the ops themselves), so the
small CPU cases run from a warm cache: read them as latency, not bandwidth.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# The flush buffer must exceed the last-level cache of the GPU (50 MB on H100).
_L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(kw_only=True, slots=True)
class Timing:
    median_ms: float
    """Median of the timed calls, in milliseconds."""
    min_ms: float
    """Fastest timed call, in milliseconds."""
    repeats: int
    """How many calls were timed."""


@dataclass(kw_only=True, slots=True)
class TimingPolicy:
    warmup: int = 3
    """Untimed calls first (caches, lazy initialisation, allocator, autotuning)."""
    max_repeats: int = 100
    """Upper bound on the timed calls."""
    min_repeats: int = 5
    """Lower bound on the timed calls, whatever the budget says."""
    budget_s: float = 0.3
    """Target time spent in timed calls per measurement; slow calls get fewer repeats."""

    def __post_init__(self) -> None:
        if self.warmup < 1:
            raise ValueError(f"TimingPolicy.warmup must be >= 1 (it also estimates the call time), got {self.warmup}")
        if not 1 <= self.min_repeats <= self.max_repeats:
            raise ValueError(
                f"TimingPolicy needs 1 <= min_repeats <= max_repeats, got {self.min_repeats} and {self.max_repeats}"
            )


class _CudaFlusher:
    def __init__(self, device: torch.device) -> None:
        self.buf = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


def time_fn(fn: Callable[[], object], device: str | torch.device, policy: TimingPolicy) -> Timing:
    """Warm ``fn`` up, then time ``policy``-many calls of it; returns the median.

    The number of timed calls is ``budget_s / (time of the last warm-up call)``,
    clamped to ``[min_repeats, max_repeats]``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _time_cuda(fn, device, policy)
    if device.type != "cpu":
        raise ValueError(f"stagewise.measure: device must be 'cpu' or 'cuda', got {device}")
    est = 0.0
    for _ in range(policy.warmup):
        t0 = time.perf_counter()
        fn()
        est = time.perf_counter() - t0
    samples = []
    for _ in range(_repeats(policy, est)):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _summarise(samples)


def _time_cuda(fn: Callable[[], object], device: torch.device, policy: TimingPolicy) -> Timing:
    with torch.cuda.device(device):
        flush = _CudaFlusher(device)
        for _ in range(policy.warmup):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        est = start.elapsed_time(end) / 1e3
        n = _repeats(policy, est)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(starts, ends):
            flush()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return _summarise([s.elapsed_time(e) for s, e in zip(starts, ends)])


def _repeats(policy: TimingPolicy, est_s: float) -> int:
    n = policy.max_repeats if est_s <= 0 else int(policy.budget_s / est_s)
    return max(policy.min_repeats, min(policy.max_repeats, n))


def _summarise(samples_ms: list[float]) -> Timing:
    return Timing(median_ms=statistics.median(samples_ms), min_ms=min(samples_ms), repeats=len(samples_ms))


def copy_bandwidth(device: str | torch.device, nbytes: int, policy: TimingPolicy) -> dict:
    """The device's measured memory ceiling: ``dst.copy_(src)`` of ``nbytes``.

    Bandwidth counts the bytes read plus the bytes written (``2 * nbytes``) over
    the median time, the same way the op cases count their bytes.
    """
    n = nbytes // 4
    src = torch.randn(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, policy)
    moved = 2 * n * 4
    return {"bytes": moved, "median_ms": t.median_ms, "repeats": t.repeats, "gbps": moved / t.median_ms / 1e6}


def read_bandwidth(device: str | torch.device, nbytes: int, policy: TimingPolicy) -> dict:
    """The device's measured streaming-read ceiling: ``src.sum()`` over ``nbytes`` of float32, the
    least an op that reads its operand once must do (a decode step's linears: their weights).
    Bandwidth counts the bytes read over the median time."""
    src = torch.randn(nbytes // 4, dtype=torch.float32, device=device)
    t = time_fn(lambda: src.sum(), device, policy)
    moved = src.numel() * 4
    return {"bytes": moved, "median_ms": t.median_ms, "repeats": t.repeats, "gbps": moved / t.median_ms / 1e6}

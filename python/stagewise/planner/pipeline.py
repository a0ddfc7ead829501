"""Pipeline communication, fill-drain latency, bubble and the breakdown line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stagewise.planner.profiles import Link


def estimate_hidden_states_message_bytes(num_tokens: int, hidden_size: int, dtype_size: int) -> int:
    """The hidden states one hop carries: ``num_tokens * hidden_size * dtype_size`` bytes."""
    for name, value in (("num_tokens", num_tokens), ("hidden_size", hidden_size), ("dtype_size", dtype_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"estimate_hidden_states_message_bytes: {name} must be an int >= 0, got {value!r}")
    return num_tokens * hidden_size * dtype_size


@dataclass(frozen=True, slots=True)
class PipelineSendRecvEvent:
    src_stage: int
    dst_stage: int
    message_bytes: int
    latency_s: float


def build_pipeline_send_recv_events(num_stages: int, message_bytes: int, link: Link) -> list[PipelineSendRecvEvent]:
    """One hidden-states hop per adjacent pair ``i -> i + 1`` (none for one stage)."""
    if num_stages < 1:
        raise ValueError(f"build_pipeline_send_recv_events: num_stages must be >= 1, got {num_stages}")
    t = link.one_way_s(message_bytes)
    return [PipelineSendRecvEvent(i, i + 1, message_bytes, t) for i in range(num_stages - 1)]


def stage_comm_times(num_stages: int, events: Sequence[PipelineSendRecvEvent]) -> list[tuple[float, float]]:
    """``(incoming, outgoing)`` per stage: the first stage only sends, the
    last only receives, middle stages both; one stage or empty messages: zero."""
    comm = [[0.0, 0.0] for _ in range(num_stages)]
    for e in events:
        if not (0 <= e.src_stage < num_stages and 0 <= e.dst_stage < num_stages):
            raise ValueError(f"stage_comm_times: event {e} names a stage outside [0, {num_stages})")
        comm[e.src_stage][1] += e.latency_s
        comm[e.dst_stage][0] += e.latency_s
    return [(a, b) for a, b in comm]


@dataclass(frozen=True, slots=True)
class PipelineRuntimeEstimate:
    """One pass of ``num_microbatches`` through the stages: fill-drain latency
    ``sum(stage_times) + (m - 1) * max(stage_times)``, each stage time its compute plus its hops."""

    latency_s: float
    stage_compute_times_s: tuple[float, ...]
    stage_comm_times_s: tuple[float, ...]
    stage_times_s: tuple[float, ...]
    num_microbatches: int
    send_recv_events: tuple[PipelineSendRecvEvent, ...] = ()
    stage_comm_in_out_s: tuple[tuple[float, float], ...] = field(default=())

    @property
    def bubble_s(self) -> float:
        """The time beyond one microbatch's stage times: ``max(0, latency - sum(stage_times))``."""
        return max(0.0, self.latency_s - sum(self.stage_times_s))

    def breakdown(self) -> dict[str, float]:
        """Where the pipeline's latency goes: compute, communication, bubble (seconds)."""
        return {"compute": sum(self.stage_compute_times_s), "communication": sum(self.stage_comm_times_s),
                "bubble": self.bubble_s}


def estimate_pipeline_runtime_from_stage_times(compute_s: Sequence[float], comm_s: Sequence[float],
                                               num_microbatches: int = 1,
                                               events: Sequence[PipelineSendRecvEvent] = (),
                                               comm_in_out: Sequence[tuple[float, float]] = ()
                                               ) -> PipelineRuntimeEstimate:
    """``stage_time = compute + comm``; ``latency = sum(stage_times) + (m - 1) * max(stage_times)``."""
    if len(compute_s) != len(comm_s) or not compute_s:
        raise ValueError(f"estimate_pipeline_runtime_from_stage_times: need one compute and one comm time per stage, "
                         f"got {len(compute_s)} and {len(comm_s)}")
    if any(t < 0 for t in (*compute_s, *comm_s)):
        raise ValueError("estimate_pipeline_runtime_from_stage_times: times must be >= 0")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"estimate_pipeline_runtime_from_stage_times: num_microbatches must be an int >= 1, "
                         f"got {num_microbatches!r}")
    stage_times = tuple(a + b for a, b in zip(compute_s, comm_s))
    latency = sum(stage_times) + (num_microbatches - 1) * max(stage_times)
    return PipelineRuntimeEstimate(latency, tuple(compute_s), tuple(comm_s), stage_times, num_microbatches,
                                   tuple(events), tuple(comm_in_out))


def estimate_decode_steady_state(compute_s: Sequence[float], hop_s: Sequence[float], num_microbatches: int = 1,
                                 events: Sequence[PipelineSendRecvEvent] = ()) -> PipelineRuntimeEstimate:
    """One decode step of every microbatch when the runtime keeps them cycling through the stages.

    ``hop_s[i]``: stage ``i``'s outgoing hop (to ``i + 1``; the last stage's goes back to stage 0
    with the sampled tokens), so a microbatch's round trip is ``sum(compute) + sum(hops)`` and each
    stage is occupied ``compute + hop`` per microbatch. With ``m`` microbatches in flight the step
    takes ``max(round trip, m * max(compute + hop))``: the round trip when the stages wait for each
    other, the busiest stage when it is the bottleneck (the fill-drain formula describes a
    batch that passes once; decode steps repeat, and the pipeline never drains between them).
    ``bubble_s`` is then the step beyond one microbatch's stage times (0 for one microbatch).
    Microbatches of different sizes: :func:`estimate_decode_groups`."""
    if len(compute_s) != len(hop_s) or not compute_s:
        raise ValueError(f"estimate_decode_steady_state: need one compute and one hop time per stage, "
                         f"got {len(compute_s)} and {len(hop_s)}")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"estimate_decode_steady_state: num_microbatches must be an int >= 1, "
                         f"got {num_microbatches!r}")
    return estimate_decode_groups([[c] * num_microbatches for c in compute_s], hop_s, events)


def estimate_decode_groups(compute_s: Sequence[Sequence[float]], hop_s: Sequence[float],
                           events: Sequence[PipelineSendRecvEvent] = ()) -> PipelineRuntimeEstimate:
    """:func:`estimate_decode_steady_state` with ``compute_s[i][g]``: stage ``i``'s time for group
    ``g`` (the runtime deals a batch to its groups as evenly as it can, so they may differ by a
    row). A step lasts ``max(max_g round trip of g, max_i sum_g (compute[i][g] + hop[i]))``; the
    estimate's per-stage compute and stage times are the means over the groups, so that ``m`` times
    them is a stage's work in a step and ``bubble_s`` is the step beyond it."""
    if len(compute_s) != len(hop_s) or not compute_s:
        raise ValueError(f"estimate_decode_groups: need one compute row and one hop time per stage, "
                         f"got {len(compute_s)} and {len(hop_s)}")
    m = len(compute_s[0])
    if m < 1 or any(len(row) != m for row in compute_s):
        raise ValueError("estimate_decode_groups: every stage needs the same number (>= 1) of group times")
    if any(t < 0 for row in compute_s for t in row) or any(t < 0 for t in hop_s):
        raise ValueError("estimate_decode_groups: times must be >= 0")
    round_trip = max(sum(compute_s[i][g] + hop_s[i] for i in range(len(hop_s))) for g in range(m))
    busiest = max(sum(row) + m * h for row, h in zip(compute_s, hop_s))
    mean = tuple(sum(row) / m for row in compute_s)
    stage_times = tuple(c + h for c, h in zip(mean, hop_s))
    return PipelineRuntimeEstimate(max(round_trip, busiest), mean, tuple(hop_s), stage_times, m, tuple(events),
                                   tuple((0.0, h) for h in hop_s))


def fill_drain_finish(stage_times_s: Sequence[Sequence[float]]) -> list[float]:
    """When each microbatch leaves the last stage in one fill-drain pass (prefill):
    ``stage_times_s[i][g]`` is stage ``i``'s time for microbatch ``g`` (its compute and comm); a
    stage takes microbatches in order, each once the previous stage handed it on. With equal
    microbatches the last one leaves at ``sum(stage_times) + (m - 1) * max(stage_times)``,
    the first at ``sum(stage_times)``."""
    if not stage_times_s or not stage_times_s[0] or any(len(r) != len(stage_times_s[0]) for r in stage_times_s):
        raise ValueError("fill_drain_finish: need the same number (>= 1) of microbatch times per stage")
    done = [0.0] * len(stage_times_s[0])
    for row in stage_times_s:
        free = 0.0
        for g, t in enumerate(row):
            free = max(free, done[g]) + t
            done[g] = free
    return done


def format_breakdowns(op_bound: Mapping[str, float] | None, pipeline: Mapping[str, float] | None) -> str:
    """``Mem 25.00 | Comm 25.00 | Cube 50.00 | Vec 0.00 | PP Compute 50.00 | PP Comm 16.67 |
    PP Bubble 33.33``: the share of operator time bound by memory, communication, matrix and vector
    FLOPs (of the summed op times), then of the pipeline's latency spent computing, sending and idle
    (of compute + communication + bubble, which is the latency)."""
    parts = []
    if op_bound:
        total = sum(op_bound.values())
        for key, label in (("mem", "Mem"), ("comm", "Comm"), ("cube", "Cube"), ("vec", "Vec")):
            parts.append(f"{label} {100 * op_bound.get(key, 0.0) / total if total else 0.0:.2f}")
    if pipeline:
        total = sum(pipeline.values())
        for key, label in (("compute", "PP Compute"), ("communication", "PP Comm"), ("bubble", "PP Bubble")):
            parts.append(f"{label} {100 * pipeline.get(key, 0.0) / total if total else 0.0:.2f}")
    return " | ".join(parts)

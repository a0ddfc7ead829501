"""One layout, one workload: memory per rank, prefill and decode pipelines, TTFT, TPOT, tokens/s.

Workload: each DP replica serves ``batch`` sequences of ``input_length`` prompt tokens and
``output_length`` generated tokens, split into ``m`` microbatches (default ``min(batch, pp)``,
as the runtime keeps up to one microbatch per stage in flight). TTFT is the prefill's pipeline
latency (§2.7.4) plus the sampled tokens' way back to stage 0; TPOT one decode step of every
microbatch at the mean context ``input_length + output_length // 2`` in the runtime's steady
state (:func:`~stagewise.planner.pipeline.estimate_decode_steady_state`: groups cycle through the
stages, the tokens hop back to stage 0 each step); on a CPU profile, stage processes that
compute at the same time slow each other (:func:`slowdown` at the mean number busy); tokens/s = ``dp * batch * output_length /
(TTFT + (output_length - 1) * TPOT)``. A layout fits when every stage's weights plus KV (at the
full ``input_length + output_length``) fit in ``memory_fraction`` of a device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from stagewise.model import shapes
from stagewise.model.config import ModelConfig
from stagewise.parallel.plan import StagePlan
from stagewise.parallel.ranks import ParallelConfig
from stagewise.planner import compute, memory
from stagewise.planner.pipeline import (
    PipelineRuntimeEstimate,
    build_pipeline_send_recv_events,
    estimate_decode_steady_state,
    estimate_hidden_states_message_bytes,
    estimate_pipeline_runtime_from_stage_times,
    format_breakdowns,
    stage_comm_times,
)
from stagewise.planner.profiles import DTYPE_BYTES, QUANT_BITS, DeviceProfile, dtype_name


@dataclass(frozen=True, slots=True)
class Workload:
    input_length: int
    output_length: int
    batch: int = 1
    microbatches: int | None = None
    weight_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    memory_fraction: float = 0.9
    weight_quant: str = ""
    """GGUF block type the decoder linears run in (``q4_1`` ...; empty: dense ``weight_dtype``)."""
    embed_quant: str = ""
    """GGUF block type of the embedding / LM head (empty: dense)."""

    def __post_init__(self) -> None:
        for name in ("input_length", "output_length", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"workload: {name} must be an int >= 1, got {value!r}")
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ValueError(f"workload: microbatches must be an int >= 1, got {self.microbatches!r}")
        object.__setattr__(self, "weight_dtype", dtype_name(self.weight_dtype))
        object.__setattr__(self, "kv_dtype", dtype_name(self.kv_dtype))
        for name in ("weight_quant", "embed_quant"):
            if getattr(self, name) and getattr(self, name) not in QUANT_BITS:
                raise ValueError(f"workload: {name} must be one of {sorted(QUANT_BITS)} or empty, "
                                 f"got {getattr(self, name)!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"workload: memory_fraction must be in (0, 1], got {self.memory_fraction}")

    def precision(self) -> compute.Precision:
        w = DTYPE_BYTES[self.weight_dtype]
        # Activations and compute in the weights' dtype (fp8 weights compute in bf16).
        act_dtype = self.weight_dtype if self.weight_dtype != "float8" else "bfloat16"
        return compute.Precision(weight=w, act=DTYPE_BYTES[act_dtype], kv=DTYPE_BYTES[self.kv_dtype],
                                 compute_dtype=self.weight_dtype, weight_quant=self.weight_quant,
                                 embed_quant=self.embed_quant)


@dataclass(frozen=True, slots=True)
class PhaseEstimate:
    """One phase (prefill or one decode step) through the pipeline."""

    pipeline: PipelineRuntimeEstimate
    rows_per_microbatch: int
    new_tokens: int
    context: int
    op_bound: dict[str, float]
    """Seconds by bound over every stage (mem, comm, cube, vec)."""

    def breakdown_line(self) -> str:
        return format_breakdowns(self.op_bound, self.pipeline.breakdown())


@dataclass(frozen=True, slots=True)
class LayoutEstimate:
    layout: ParallelConfig
    plan: StagePlan
    stage_memory: list[memory.StageMemory]
    weight_bytes_per_rank: int
    kv_bytes_per_rank: int
    memory_per_rank: int
    fits: bool
    prefill: PhaseEstimate
    decode: PhaseEstimate
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        lay = self.layout

        def phase(p: PhaseEstimate) -> dict:
            e = p.pipeline
            return {"latency_s": e.latency_s, "num_microbatches": e.num_microbatches,
                    "rows_per_microbatch": p.rows_per_microbatch, "new_tokens": p.new_tokens, "context": p.context,
                    "stage_compute_times_s": list(e.stage_compute_times_s),
                    "stage_comm_times_s": list(e.stage_comm_times_s), "stage_times_s": list(e.stage_times_s),
                    "bubble_s": e.bubble_s, "breakdown_s": e.breakdown(), "op_bound_s": p.op_bound,
                    "breakdown": p.breakdown_line(),
                    "send_recv_events": [{"src_stage": s.src_stage, "dst_stage": s.dst_stage,
                                          "message_bytes": s.message_bytes, "latency_s": s.latency_s}
                                         for s in e.send_recv_events]}

        return {"parallel": lay.label(), "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep,
                "moe_tp": lay.moe_tp, "moe_dp": lay.moe_dp, "partition": self.plan.policy,
                "stage_ranges": self.plan.ranges, "stages": [s.to_dict() for s in self.stage_memory],
                "weight_bytes_per_rank": self.weight_bytes_per_rank, "kv_bytes_per_rank": self.kv_bytes_per_rank,
                "memory_per_rank": self.memory_per_rank, "fits": self.fits, "ttft_s": self.ttft_s,
                "tpot_s": self.tpot_s, "tokens_per_s": self.tokens_per_s, "prefill": phase(self.prefill),
                "decode": phase(self.decode), "notes": self.notes}


def slowdown(profile: DeviceProfile, busy: float) -> float:
    """How much slower a stage computes than the profile's rates say while ``busy`` stage processes
    (one thread each; a mean, may be fractional) compute at once on a CPU. Measured:
    ``concurrency[n] / concurrency[ref]`` of the profile (n single-thread workers side by side
    against one when the rates were measured), linear between the measured counts, scaled by
    ``busy / n`` beyond the largest; else ``max(1, busy / cores)`` (they take turns). 1 on GPUs."""
    if profile.kind != "cpu":
        return 1.0
    busy = max(busy, 1.0)
    conc = profile.concurrency
    counts = sorted(int(k) for k in conc if k != "ref")
    if counts:
        ref = conc.get("ref", conc.get("1"))
        g = {n: conc[str(n)] / ref for n in counts}
        if busy <= counts[0]:
            return g[counts[0]]
        if busy >= counts[-1]:
            return g[counts[-1]] * busy / counts[-1]
        lo = max(n for n in counts if n <= busy)
        hi = min(n for n in counts if n >= busy)
        return g[lo] if hi == lo else g[lo] + (g[hi] - g[lo]) * (busy - lo) / (hi - lo)
    if not profile.cores:
        return 1.0
    return max(1.0, busy / profile.cores)


def contention(profile: DeviceProfile, num_stages: int, m: int) -> float:
    """:func:`slowdown` with ``min(m, S)`` stage processes busy all the time (an upper bound)."""
    return slowdown(profile, min(m, num_stages))


def feedback_s(profile: DeviceProfile, num_stages: int, rows: int) -> float:
    """The sampled tokens' hop back to stage 0 (int64 ids over the PP link) and stage 0 taking them
    (profile ``framework.tokens_s``); 0 for one stage."""
    if num_stages == 1:
        return 0.0
    return profile.links["pp"].one_way_s(rows * 8) + profile.framework.get("tokens_s", 0.0)


def _phase(config: ModelConfig, plan: StagePlan, profile: DeviceProfile, prec: compute.Precision,
           sharding: shapes.Sharding, *, batch: int, m: int, new_tokens: int, context: int) -> PhaseEstimate:
    rows = math.ceil(batch / m)
    base, base_bounds = [], []
    for info in plan.stages:
        ops = compute.stage_ops(config, info, rows=rows, new_tokens=new_tokens, context=context, prec=prec,
                                sharding=sharding)
        sc = compute.stage_compute(ops, profile, prec.compute_dtype, role=compute.stage_role(info),
                                   num_layers=len(info.active_layer_indices))
        base.append(sc.time_s)
        base_bounds.append(sc.by_bound)
    nbytes = estimate_hidden_states_message_bytes(rows * new_tokens, config.hidden_size, prec.act)
    events = build_pipeline_send_recv_events(plan.num_stages, nbytes, profile.links["pp"])
    hops = [e.latency_s for e in events] + [feedback_s(profile, plan.num_stages, rows)]

    def run(slow: float) -> PipelineRuntimeEstimate:
        comp = [t * slow for t in base]
        if new_tokens == 1:  # decode: the runtime's steady state, tokens going back to stage 0 each step
            return estimate_decode_steady_state(comp, hops, m, events)
        in_out = stage_comm_times(plan.num_stages, events)  # prefill: one pass, fill-drain (§2.7.4)
        return estimate_pipeline_runtime_from_stage_times(comp, [a + b for a, b in in_out], m, events, in_out)

    # Stage processes slow each other while they compute at once: the mean number busy is the sum of
    # their utilisations (m microbatches' compute over the phase's latency), found by fixed point.
    slow = slowdown(profile, 1.0)
    est = run(slow)
    if plan.num_stages > 1 and m > 1:
        for _ in range(50):
            busy = sum(m * c for c in est.stage_compute_times_s) / est.latency_s
            new = slowdown(profile, min(busy, plan.num_stages))
            if abs(new - slow) < 1e-6 * slow:
                break
            slow = 0.5 * (slow + new)
            est = run(slow)
    bounds = dict.fromkeys(compute.BOUNDS, 0.0)
    for by in base_bounds:
        for k, v in by.items():
            bounds[k] += v * slow
    return PhaseEstimate(est, rows, new_tokens, context, bounds)


def estimate_layout(config: ModelConfig, layout: ParallelConfig, workload: Workload, profile: DeviceProfile, *,
                    partition: str = "even", total_params: float | None = None) -> LayoutEstimate:
    """Everything the planner predicts for ``layout`` (ValueError when the model cannot take it)."""
    sharding = shapes.Sharding(layout.tp, layout.ep, layout.moe_tp if config.num_experts else 1)
    shapes.check_sharding(config, sharding)
    plan = StagePlan.for_model(config, layout.pp, partition)
    prec = workload.precision()
    total_tokens = workload.input_length + workload.output_length
    stage_mem = memory.stage_memory(config, plan, tokens=total_tokens, batch=workload.batch,
                                    weight_bytes=prec.weight, kv_bytes_per_elem=prec.kv,
                                    total_params=total_params, sharding=sharding)
    per_stage = [s.weight_bytes_exact + s.kv_bytes for s in stage_mem]
    need = max(per_stage)
    m = workload.microbatches or min(workload.batch, layout.pp)
    m = min(m, workload.batch)
    prefill = _phase(config, plan, profile, prec, sharding, batch=workload.batch, m=m,
                     new_tokens=workload.input_length, context=0)
    decode = _phase(config, plan, profile, prec, sharding, batch=workload.batch, m=m, new_tokens=1,
                    context=workload.input_length + workload.output_length // 2)
    # The first token exists once the last stage sampled it and stage 0 took it back.
    ttft = prefill.pipeline.latency_s + feedback_s(profile, plan.num_stages, math.ceil(workload.batch / m))
    tpot = decode.pipeline.latency_s
    total = ttft + (workload.output_length - 1) * tpot
    notes = []
    if plan.num_stages > 1 and config.is_multimodal:
        notes.append("vision tower stored on stage 0, not timed (text requests)")
    return LayoutEstimate(
        layout=layout, plan=plan, stage_memory=stage_mem,
        weight_bytes_per_rank=max(s.weight_bytes_exact for s in stage_mem),
        kv_bytes_per_rank=max(s.kv_bytes for s in stage_mem), memory_per_rank=need,
        fits=need <= workload.memory_fraction * profile.memory_bytes, prefill=prefill, decode=decode,
        ttft_s=ttft, tpot_s=tpot, tokens_per_s=layout.dp * workload.batch * workload.output_length / total,
        notes=notes)

"""One layout, one workload: memory per rank, prefill and decode pipelines, TTFT, TPOT, tokens/s.

Workload: each DP replica serves ``batch`` sequences of ``input_length`` prompt tokens and
``output_length`` generated tokens, split into ``m`` microbatches (default ``min(batch, pp)``,
as the runtime keeps up to one microbatch per stage in flight), dealt as the runtime's grouped
scheduler deals them (:func:`group_rows`: sizes differ by at most one row).

Prefill: the fill-drain pipeline latency ``sum(stage_times) + (m - 1) * max(stage_times)`` (every
microbatch at the largest one's size). The first
token exists once the first microbatch has passed every stage and its sampled tokens are back
on stage 0; the batch has all its first tokens once the last microbatch has
(:func:`~stagewise.planner.pipeline.fill_drain_finish`, the same formula for equal microbatches). TTFT is
the first, as the runtime measures it (submit to the batch's first token).

Decode: one step of every microbatch at the mean context ``input_length + output_length // 2``
in the runtime's steady state (:func:`~stagewise.planner.pipeline.estimate_decode_groups`:
groups cycle through the stages, the tokens hop back to stage 0 each step), ``tpot_steady_s``.
The decode phase as a client sees it starts at the first token, while later microbatches are
still in their prefill: the stages spend that fill (last microbatch's first token minus the
first's) before the steady state, so TPOT = decode time / steps = ``tpot_steady_s + fill /
(output_length - 1)``. On a CPU profile, stage processes that compute at the same time slow each
other (:func:`slowdown` at the mean number busy). tokens/s = ``dp * batch * output_length / (TTFT
+ (output_length - 1) * TPOT)``. A layout fits when every stage's weights plus KV (at the full
``input_length + output_length``, stored as ``kv_cache_dtype`` says) fit in ``memory_fraction`` of a
device; ``max_batch`` is the most sequences per replica that would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stagewise.kv.cache import check_kv_cache_dtype
from stagewise.model import architectures, shapes
from stagewise.model.config import ModelConfig
from stagewise.parallel.plan import StagePlan
from stagewise.parallel.ranks import ParallelConfig
from stagewise.planner import compute, memory
from stagewise.planner.pipeline import (
    PipelineRuntimeEstimate,
    build_pipeline_send_recv_events,
    estimate_decode_groups,
    estimate_hidden_states_message_bytes,
    estimate_pipeline_runtime_from_stage_times,
    fill_drain_finish,
    format_breakdowns,
    stage_comm_times,
)
from stagewise.planner.profiles import DTYPE_BYTES, QUANT_BITS, DeviceProfile, dtype_name, process_slowdown


@dataclass(frozen=True, slots=True)
class Workload:
    input_length: int
    output_length: int
    batch: int = 1
    microbatches: int | None = None
    weight_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    """A K/V value's dtype while ``kv_cache_dtype`` is ``auto`` (the runtime: the activations')."""
    memory_fraction: float = 0.9
    weight_quant: str = ""
    """GGUF block type the decoder linears run in (``q4_1`` ...; empty: dense ``weight_dtype``)."""
    embed_quant: str = ""
    """GGUF block type of the embedding / LM head (empty: dense)."""
    image_tokens: int = 0
    """Of each prompt's ``input_length`` tokens, this many are one image's (a vision model: the
    prefill runs its vision tower on stage 0 over ``image_tokens * merge ** 2`` patches)."""
    prefix_share: float = 0.0
    """Of each prompt, the share found in the prefix cache (its first tokens, image first): the
    prefill computes the rest over the whole prompt's context. The KV of a sequence still counts
    whole: a request holds its cached blocks, and the cached blocks nobody holds take no capacity
    (they are evicted when it is needed)."""

    speculative_tokens: int = 0
    """Draft tokens per request and decode step (speculative decoding): a decode step runs
    ``1 + speculative_tokens`` tokens per row."""
    acceptance: float = 0.0
    """The chance each draft is accepted (given the ones before it were): a step then yields
    ``(1 - a ** (k + 1)) / (1 - a)`` tokens per row."""
    kv_cache_dtype: str = "auto"
    """What the cache stores a K/V value as (:data:`stagewise.kv.cache.KV_CACHE_DTYPES`): ``auto``,
    ``kv_dtype``; ``int8`` or ``fp8_e4m3``, one-byte codes with a float16 scale per token and KV head."""

    @property
    def kv_label(self) -> str:
        """How reports name what K/V are stored as."""
        return self.kv_dtype if self.kv_cache_dtype == "auto" else f"{self.kv_cache_dtype} (+ float16 scales)"

    @property
    def tokens_per_step(self) -> float:
        """Tokens a decode step yields per row: 1, or with drafts 1 + the expected accepted ones."""
        k, a = self.speculative_tokens, self.acceptance
        return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens a request finds cached; at least the last is always computed."""
        return min(int(self.prefix_share * self.input_length), self.input_length - 1)

    def __post_init__(self) -> None:
        for name in ("input_length", "output_length", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"workload: {name} must be an int >= 1, got {value!r}")
        if isinstance(self.image_tokens, bool) or not isinstance(self.image_tokens, int) \
                or not 0 <= self.image_tokens <= self.input_length:
            raise ValueError(f"workload: image_tokens must be an int in [0, input_length={self.input_length}], "
                             f"got {self.image_tokens!r}")
        if isinstance(self.prefix_share, bool) or not isinstance(self.prefix_share, (int, float)) \
                or not 0 <= self.prefix_share <= 1:
            raise ValueError(f"workload: prefix_share must be a number in [0, 1], got {self.prefix_share!r}")
        if isinstance(self.speculative_tokens, bool) or not isinstance(self.speculative_tokens, int) \
                or self.speculative_tokens < 0 or not 0 <= self.acceptance <= 1:
            raise ValueError(f"workload: speculative_tokens must be an int >= 0 and acceptance a number in [0, 1], "
                             f"got {self.speculative_tokens!r} and {self.acceptance!r}")
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ValueError(f"workload: microbatches must be an int >= 1, got {self.microbatches!r}")
        object.__setattr__(self, "weight_dtype", dtype_name(self.weight_dtype))
        object.__setattr__(self, "kv_dtype", dtype_name(self.kv_dtype))
        check_kv_cache_dtype(self.kv_cache_dtype)
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
                                 embed_quant=self.embed_quant, kv_cache_dtype=self.kv_cache_dtype)


@dataclass(frozen=True, slots=True)
class PhaseEstimate:
    """One phase (prefill or one decode step) through the pipeline."""

    pipeline: PipelineRuntimeEstimate
    rows_per_microbatch: int
    new_tokens: int
    context: int
    op_bound: dict[str, float]
    """Seconds by bound over every stage (mem, comm, cube, vec)."""
    group_rows: tuple[int, ...] = ()
    """Rows of each microbatch as the runtime deals them (the largest is ``rows_per_microbatch``)."""
    first_tokens_s: tuple[float, ...] = ()
    """Prefill: when each microbatch's first tokens are back on stage 0 (fill-drain pass)."""

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
    """The batch's first token (the first microbatch's, back on stage 0)."""
    tpot_s: float
    """Decode time / steps from the first token on: ``tpot_steady_s`` plus the prefill fill spread
    over the steps."""
    tokens_per_s: float
    notes: list[str] = field(default_factory=list)
    tpot_steady_s: float = 0.0
    """One decode step of every microbatch in the steady state."""
    fill_s: float = 0.0
    """From the first microbatch's first token to the last one's (0 for one microbatch)."""
    max_batch: int = 0
    """The most sequences per replica whose KV fits beside the weights (:func:`memory.max_batch`)."""

    @property
    def decode_bubble_s(self) -> float:
        """The decode's bubble as measured: TPOT beyond one microbatch's stage times."""
        return max(0.0, self.tpot_s - sum(self.decode.pipeline.stage_times_s))

    def to_dict(self) -> dict:
        lay = self.layout

        def phase(p: PhaseEstimate) -> dict:
            e = p.pipeline
            return {"latency_s": e.latency_s, "num_microbatches": e.num_microbatches,
                    "rows_per_microbatch": p.rows_per_microbatch, "new_tokens": p.new_tokens, "context": p.context,
                    "stage_compute_times_s": list(e.stage_compute_times_s),
                    "stage_comm_times_s": list(e.stage_comm_times_s), "stage_times_s": list(e.stage_times_s),
                    "bubble_s": e.bubble_s, "breakdown_s": e.breakdown(), "op_bound_s": p.op_bound,
                    "breakdown": p.breakdown_line(), "group_rows": list(p.group_rows),
                    "first_tokens_s": list(p.first_tokens_s),
                    "send_recv_events": [{"src_stage": s.src_stage, "dst_stage": s.dst_stage,
                                          "message_bytes": s.message_bytes, "latency_s": s.latency_s}
                                         for s in e.send_recv_events]}

        return {"parallel": lay.label(), "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "pcp": lay.pcp, "dcp": lay.dcp,
                "ep": lay.ep,
                "moe_tp": lay.moe_tp, "moe_dp": lay.moe_dp, "partition": self.plan.policy,
                "stage_ranges": self.plan.ranges, "stages": [s.to_dict() for s in self.stage_memory],
                "weight_bytes_per_rank": self.weight_bytes_per_rank, "kv_bytes_per_rank": self.kv_bytes_per_rank,
                "memory_per_rank": self.memory_per_rank, "fits": self.fits, "max_batch": self.max_batch,
                "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "tpot_steady_s": self.tpot_steady_s, "fill_s": self.fill_s,
                "decode_bubble_s": self.decode_bubble_s, "tokens_per_s": self.tokens_per_s, "prefill": phase(self.prefill),
                "decode": phase(self.decode), "notes": self.notes}


def slowdown(profile: DeviceProfile, busy: float) -> float:
    """How much slower a stage computes than the profile's rates say while ``busy`` stage processes
    (one thread each; a mean, may be fractional) compute at once on a CPU. Measured:
    ``concurrency[n] / concurrency[ref]`` of the profile (n single-thread workers side by side
    against one when the rates were measured), linear between the measured counts, scaled by
    ``busy / n`` beyond the largest; else ``max(1, busy / cores)`` (they take turns). 1 on GPUs."""
    if profile.kind != "cpu":
        return 1.0
    return process_slowdown(profile, busy)


def contention(profile: DeviceProfile, num_stages: int, m: int) -> float:
    """:func:`slowdown` with ``min(m, S)`` stage processes busy all the time (an upper bound)."""
    return slowdown(profile, min(m, num_stages))


def feedback_s(profile: DeviceProfile, num_stages: int, rows: int) -> float:
    """The sampled tokens' hop back to stage 0 (int64 ids over the PP link) and stage 0 taking them
    (profile ``framework.tokens_s``); 0 for one stage."""
    if num_stages == 1:
        return 0.0
    return profile.links["pp"].one_way_s(rows * 8) + profile.framework.get("tokens_s", 0.0)


def group_rows(batch: int, m: int) -> list[int]:
    """Rows of each of ``m`` microbatches as the runtime's grouped scheduler deals ``batch``
    sequences: as evenly as possible, the first groups one more."""
    base, extra = divmod(batch, m)
    return [base + (g < extra) for g in range(m)]


def runs_python_loop(config: ModelConfig, sharding: shapes.Sharding) -> bool:
    """Whether the stages run the Python layer loop: the ranks of a TP/CP stage, the layers the C++
    loop does not take, and a model with sliding-window layers (the stage states why, in
    ``StageModel.python_loop_reason``)."""
    return (sharding.tp * sharding.pcp * sharding.dcp > 1 or architectures.of(config).decode_stack is not None
            or bool(architectures.windowed_layers(config)))


def _phase(config: ModelConfig, plan: StagePlan, profile: DeviceProfile, prec: compute.Precision,
           sharding: shapes.Sharding, *, batch: int, m: int, new_tokens: int, context: int,
           image_tokens: int = 0, decode: bool = False) -> PhaseEstimate:
    """A prefill pass, or with ``decode`` the steady decode step of ``new_tokens`` per row (1, or a
    row verifying drafts)."""
    groups = group_rows(batch, m)
    rows = max(groups)
    cache: dict[int, tuple[list[float], list[dict[str, float]]]] = {}
    python_loop = runs_python_loop(config, sharding)

    def stage_base(r: int) -> tuple[list[float], list[dict[str, float]]]:
        if r not in cache:
            times, bounds = [], []
            for info in plan.stages:
                ops = compute.stage_ops(config, info, rows=r, new_tokens=new_tokens, context=context, prec=prec,
                                        sharding=sharding, image_tokens=image_tokens)
                sc = compute.stage_compute(ops, profile, prec.compute_dtype, role=compute.stage_role(info),
                                           num_layers=len(info.active_layer_indices),
                                           python_loop=python_loop,
                                           cp=decode and sharding.dcp * sharding.pcp > 1)
                times.append(sc.time_s)
                bounds.append(sc.by_bound)
            cache[r] = times, bounds
        return cache[r]

    base, base_bounds = stage_base(rows)
    nbytes = estimate_hidden_states_message_bytes(rows * new_tokens, config.hidden_size, prec.act)
    events = build_pipeline_send_recv_events(plan.num_stages, nbytes, profile.links["pp"])
    in_out = stage_comm_times(plan.num_stages, events)

    def one_way(r: int) -> float:
        """One hop of a microbatch of ``r`` rows' hidden states to the next stage."""
        msg = estimate_hidden_states_message_bytes(r * new_tokens, config.hidden_size, prec.act)
        return profile.links["pp"].one_way_s(msg)

    def hops(r: int) -> list[float]:
        """Each stage's outgoing hop for a microbatch of ``r`` rows (the last: tokens back to stage 0)."""
        return [one_way(r)] * (plan.num_stages - 1) + [feedback_s(profile, plan.num_stages, r)]

    def run(slow: list[float]) -> PipelineRuntimeEstimate:
        if decode:  # the runtime's steady state, tokens going back to stage 0 each step
            comp = [[stage_base(r)[0][i] * slow[i] for r in groups] for i in range(plan.num_stages)]
            return estimate_decode_groups(comp, hops(rows), events)
        comp = [t * k for t, k in zip(base, slow)]  # prefill: one fill-drain pass
        return estimate_pipeline_runtime_from_stage_times(comp, [a + b for a, b in in_out], m, events, in_out)

    # Stage processes slow each other while they compute at once. While stage i computes, the
    # others are busy with the probability of their utilisation (m microbatches' compute over the
    # phase's latency), so stage i computes beside 1 + sum_(j != i) u_j busy processes on average;
    # its slowdown is taken there (a fixed point, as the utilisations depend on the slowdowns).
    slow = [slowdown(profile, 1.0)] * plan.num_stages
    est = run(slow)
    if plan.num_stages > 1 and m > 1:
        for _ in range(100):
            util = [min(1.0, m * c / est.latency_s) for c in est.stage_compute_times_s]
            new = [slowdown(profile, 1.0 + sum(util) - u) for u in util]
            if all(abs(a - b) < 1e-6 * b for a, b in zip(new, slow)):
                break
            slow = [0.5 * (a + b) for a, b in zip(slow, new)]
            est = run(slow)
    firsts: tuple[float, ...] = ()
    if not decode:
        # Each microbatch at its own size through the fill-drain pass; its first tokens are back on
        # stage 0 one feedback hop after it leaves the last stage.
        last = plan.num_stages - 1
        hop = {r: one_way(r) if last > 0 else 0.0 for r in groups}
        times = [[stage_base(r)[0][i] * slow[i] + hop[r] * ((i > 0) + (i < last)) for r in groups]
                 for i in range(plan.num_stages)]
        firsts = tuple(t + feedback_s(profile, plan.num_stages, r)
                       for t, r in zip(fill_drain_finish(times), groups))
    bounds = dict.fromkeys(compute.BOUNDS, 0.0)
    for by, k_slow in zip(base_bounds, slow):
        for k, v in by.items():
            bounds[k] += v * k_slow
    return PhaseEstimate(est, rows, new_tokens, context, bounds, tuple(groups), firsts)


def ranks_outnumber_cores(layout: ParallelConfig, profile: DeviceProfile) -> bool:
    """Whether a CPU layout of stages of several ranks has more rank processes than cores: its
    ranks then wait in their collectives for partners the OS has descheduled, which the estimate
    does not price (it says so in a note)."""
    return (profile.kind == "cpu" and bool(profile.cores) and layout.tp * layout.pcp > 1
            and layout.pp * layout.tp * layout.pcp > profile.cores)


def layout_sharding(config: ModelConfig, layout: ParallelConfig) -> shapes.Sharding:
    """What one rank of ``layout`` holds and computes: TP, EP, MoE-TP (dense models: 1), DCP and PCP."""
    return shapes.Sharding(layout.tp, layout.ep, layout.moe_tp if config.moe else 1, dcp=layout.dcp,
                           pcp=layout.pcp)


def estimate_layout(config: ModelConfig, layout: ParallelConfig, workload: Workload, profile: DeviceProfile, *,
                    partition: str = "even", total_params: float | None = None) -> LayoutEstimate:
    """Everything the planner predicts for ``layout`` (ValueError when the model cannot take it)."""
    # A stage's ranks are processes computing at once: on a CPU they take turns on the cores.
    profile = profile.for_ranks(layout.tp * layout.pcp)
    sharding = layout_sharding(config, layout)
    memory.check_layout(config, sharding)
    plan = StagePlan.for_model(config, layout.pp, partition)
    prec = workload.precision()
    total_tokens = workload.input_length + workload.output_length
    stage_mem = memory.stage_memory(config, plan, tokens=total_tokens, batch=workload.batch,
                                    weight_bytes=prec.weight, kv_bytes_per_elem=prec.kv,
                                    total_params=total_params, sharding=sharding,
                                    kv_cache_dtype=workload.kv_cache_dtype)
    per_stage = [s.weight_bytes_exact + s.kv_bytes for s in stage_mem]
    need, budget = max(per_stage), workload.memory_fraction * profile.memory_bytes
    m = workload.microbatches or min(workload.batch, layout.pp)
    m = min(m, workload.batch)
    cached = workload.cached_tokens  # the vision tower runs while any of the image is left to compute
    prefill = _phase(config, plan, profile, prec, sharding, batch=workload.batch, m=m,
                     new_tokens=workload.input_length - cached, context=cached,
                     image_tokens=workload.image_tokens if workload.image_tokens > cached else 0)
    decode = _phase(config, plan, profile, prec, sharding, batch=workload.batch, m=m,
                    new_tokens=1 + workload.speculative_tokens,
                    context=workload.input_length + workload.output_length // 2, decode=True)
    # The first token exists once the last stage sampled it and stage 0 took it back; the decode
    # as measured from there also holds the rest of the prefill (the fill).
    ttft = prefill.first_tokens_s[0]
    fill = prefill.first_tokens_s[-1] - ttft
    steady = decode.pipeline.latency_s / workload.tokens_per_step  # per token: a step yields that many
    tpot = steady + (fill / (workload.output_length - 1) if workload.output_length > 1 else 0.0)
    total = prefill.first_tokens_s[-1] + (workload.output_length - 1) * steady  # = ttft + (O - 1) * tpot
    notes = []
    if ranks_outnumber_cores(layout, profile):
        notes.append(f"{layout.pp * layout.tp * layout.pcp} rank processes on {profile.cores} cores: while stages "
                     "compute at once, a stage's ranks wait in their collectives for partners the OS has "
                     "descheduled, which this estimate does not price (measured: TPOT 15-30 % above it); give "
                     "each rank a core")
    if config.is_multimodal:
        notes.append(f"vision tower on stage 0, timed for one image of {workload.image_tokens} tokens per prompt"
                     if workload.image_tokens else "vision tower stored on stage 0, not timed (text requests)")
    return LayoutEstimate(
        layout=layout, plan=plan, stage_memory=stage_mem,
        weight_bytes_per_rank=max(s.weight_bytes_exact for s in stage_mem),
        kv_bytes_per_rank=max(s.kv_bytes for s in stage_mem), memory_per_rank=need,
        fits=need <= budget, max_batch=memory.max_batch(stage_mem, budget), prefill=prefill, decode=decode,
        ttft_s=ttft, tpot_s=tpot, tokens_per_s=layout.dp * workload.batch * workload.output_length / total,
        notes=notes, tpot_steady_s=steady, fill_s=fill)

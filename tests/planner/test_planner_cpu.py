"""The planner's CPU model: block-quantised linears, the runtime's framework cost, the decode
steady state of the pipeline and core contention. Expected values are worked out by hand from
the formulas in planner/compute.py, estimate.py and pipeline.py with made-up profile numbers."""

from __future__ import annotations

import pytest
import torch

from stagewise.model.config import ModelConfig
from stagewise.parallel.plan import StagePlan
from stagewise.parallel.ranks import ParallelConfig
from stagewise.planner import compute
from stagewise.planner.estimate import Workload, contention, estimate_layout
from stagewise.planner.pipeline import estimate_decode_steady_state
from stagewise.planner.profiles import profile_from_dict

S4, S8 = 2e-9, 3e-9  # seconds per weight to decode, Q4_1 and Q8_0
LAYER, ENGINE, HEAD, MIDDLE, LAST, TOKENS = 1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 6e-5
LAT, BW = 1e-4, 1e9


def _profile(**kw) -> dict:
    huge = 1e30  # everything but the quantised decode, the framework and the links costs ~nothing
    d = {"name": "cpu-test", "kind": "cpu", "memory_bytes": 1e10, "peak_flops": {"float32": huge},
         "memory_bandwidth": huge, "op_overhead_s": 1e-3,
         "links": {k: {"latency_s": LAT, "bandwidth": BW} for k in ("tp", "pp", "ep")},
         "quant": {"q4_1": {"s_per_weight": S4, "flops": huge}, "q8_0": {"s_per_weight": S8, "flops": huge}},
         "framework": {"layer_s": LAYER, "engine_s": ENGINE, "head_s": HEAD, "middle_s": MIDDLE, "last_s": LAST,
                       "tokens_s": TOKENS},
         "cores": 2}
    d.update(kw)
    return d


def _llama(layers: int = 4) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=1000, hidden_size=64, num_layers=layers, num_heads=8,
                       num_kv_heads=4, head_dim=8, intermediate_size=128, tie_word_embeddings=True)


def _workload(batch: int = 1) -> Workload:
    return Workload(input_length=16, output_length=8, batch=batch, weight_dtype="float32", kv_dtype="float32",
                    weight_quant="q4_1", embed_quant="q8_0")


# Weights of one layer: qkv 64 x (64 + 2 * 32), o 64 x 64, gate+up 64 x 256, down 128 x 64.
LAYER_WEIGHTS = 64 * 128 + 64 * 64 + 64 * 256 + 128 * 64
HEAD_WEIGHTS = 1000 * 64


def test_quantised_linear_bytes_and_time():
    prec = compute.Precision(weight=4, act=4, kv=4, compute_dtype="float32", weight_quant="q4_1")
    op = compute.linear_op("down", prec, tokens=3, n_in=128, n_out=64, layer=0)
    assert op.weights == 128 * 64 and op.qtype == "q4_1" and op.flops == 2 * 3 * 128 * 64
    assert op.bytes == 128 * 64 * 5 / 8 + 3 * (128 + 64) * 4  # 20 bytes per 32 weights
    prof = profile_from_dict(_profile(quant={"q4_1": {"s_per_weight": 1e-9, "flops": 1e9}}, memory_bandwidth=1e12))
    t, bound = compute.op_time(op, prof, "float32")
    # Decode every weight once, then the FMAs of the 3 rows; no per-op overhead under a framework cost.
    assert bound == "cube" and t == pytest.approx(128 * 64 * 1e-9 + 2 * 3 * 128 * 64 / 1e9)
    slow_memory = profile_from_dict(_profile(quant={"q4_1": {"s_per_weight": 1e-9, "flops": 1e9}},
                                             memory_bandwidth=1e3))
    t, bound = compute.op_time(op, slow_memory, "float32")
    assert bound == "mem" and t == pytest.approx(op.bytes / 1e3)
    no_framework = profile_from_dict(_profile(framework={}, quant={"q4_1": {"s_per_weight": 1e-9, "flops": 1e9}}))
    assert compute.op_time(op, no_framework, "float32")[0] == pytest.approx(128 * 64 * 1e-9 + 2 * 3 * 128 * 64 / 1e9
                                                                            + 1e-3)


def test_stage_roles_and_framework_time():
    plans = {S: StagePlan.build(6, S).stages for S in (1, 3)}
    assert [compute.stage_role(s) for s in plans[1]] == ["engine"]
    assert [compute.stage_role(s) for s in plans[3]] == ["head", "middle", "last"]
    prof = profile_from_dict(_profile())
    assert compute.framework_time(prof, "middle", 2) == pytest.approx(2 * LAYER + MIDDLE)
    assert compute.framework_time(profile_from_dict(_profile(framework={})), "middle", 2) == 0.0


def test_decode_steady_state():
    one = estimate_decode_steady_state([1.0, 2.0, 1.0], [0.1, 0.1, 0.2], 1)
    assert one.latency_s == pytest.approx(4.4) and one.bubble_s == 0.0  # the round trip
    two = estimate_decode_steady_state([1.0, 2.0, 1.0], [0.1, 0.1, 0.2], 2)
    assert two.latency_s == pytest.approx(4.4)  # 2 x 2.1 = 4.2 < round trip 4.4
    three = estimate_decode_steady_state([1.0, 2.0, 1.0], [0.1, 0.1, 0.2], 3)
    assert three.latency_s == pytest.approx(3 * 2.1) and three.bubble_s == pytest.approx(6.3 - 4.4)
    with pytest.raises(ValueError, match="one compute and one hop time per stage"):
        estimate_decode_steady_state([1.0], [0.1, 0.2])
    with pytest.raises(ValueError, match="num_microbatches must be an int >= 1"):
        estimate_decode_steady_state([1.0], [0.1], 0)


def test_core_contention():
    cpu = profile_from_dict(_profile())
    assert contention(cpu, 3, 3) == pytest.approx(1.5)  # 3 busy stage processes on 2 cores
    assert contention(cpu, 3, 1) == 1.0 and contention(cpu, 2, 2) == 1.0 and contention(cpu, 3, 2) == 1.0
    assert contention(profile_from_dict(_profile(kind="gpu")), 3, 3) == 1.0
    assert contention(profile_from_dict(_profile(cores=None)), 3, 3) == 1.0

def test_measured_concurrency_replaces_the_core_rule():
    from stagewise.planner.estimate import slowdown

    conc = profile_from_dict(_profile(concurrency={"1": 1.0, "2": 1.6, "3": 2.4}))
    assert slowdown(conc, 2.5) == pytest.approx(2.0) and slowdown(conc, 0.3) == 1.0  # linear between counts
    assert slowdown(profile_from_dict(_profile()), 1.5) == 1.0 and slowdown(profile_from_dict(_profile()), 3) == 1.5
    assert contention(conc, 2, 2) == pytest.approx(1.6) and contention(conc, 3, 3) == pytest.approx(2.4)
    assert contention(conc, 3, 1) == 1.0
    assert contention(conc, 4, 4) == pytest.approx(2.4 * 4 / 3)  # beyond the largest measured count
    # Measured later against the profile's own one-process pass ("ref"): a busier machine now.
    noisy = profile_from_dict(_profile(concurrency={"1": 1.0, "2": 0.9, "3": 1.5}))  # 2 at once "faster": noise
    assert contention(noisy, 2, 2) == 1.0 and slowdown(noisy, 2.5) == pytest.approx(1.25)
    later = profile_from_dict(_profile(concurrency={"ref": 1.0, "1": 1.3}))
    assert contention(later, 1, 1) == pytest.approx(1.3)
    with pytest.raises(ValueError, match="field 'concurrency' must map"):
        profile_from_dict(_profile(concurrency={"2": 1.0}))


def test_decode_spans_leave_out_each_groups_prefill():
    from stagewise.bench.plan_validate.runs import decode_spans

    trace = [("compute", 0.0, 1.0, 0), ("compute", 1.0, 2.0, 1), ("send", 1.0, 0.1, 0), ("recv-wait", 3.0, 2.0, 0),
             ("compute", 5.0, 3.0, 0), ("send", 8.0, 0.2, 0), ("compute", 9.0, 4.0, 1)]
    assert decode_spans(trace) == pytest.approx((3.0 + 4.0, 0.2))


def test_decode_estimate_one_stage_and_two():
    config, prof = _llama(4), profile_from_dict(_profile())
    single = estimate_layout(config, ParallelConfig(world_size=1), _workload(), prof)
    assert single.tpot_s == pytest.approx(4 * LAYER_WEIGHTS * S4 + HEAD_WEIGHTS * S8 + 4 * LAYER + ENGINE)
    two = estimate_layout(config, ParallelConfig(world_size=2, pp=2), _workload(), prof)
    stage0 = 2 * LAYER_WEIGHTS * S4 + 2 * LAYER + HEAD
    stage1 = 2 * LAYER_WEIGHTS * S4 + HEAD_WEIGHTS * S8 + 2 * LAYER + LAST
    hop, back = LAT + 64 * 4 / BW, LAT + 8 / BW + TOKENS  # one float32 row on; one int64 token back
    d = two.decode.pipeline
    assert d.stage_compute_times_s == pytest.approx((stage0, stage1))
    assert two.tpot_s == pytest.approx(stage0 + stage1 + hop + back) and d.bubble_s == 0.0
    # Batch 4 on 3 stages: 3 groups of 2, 1, 1 rows (as the runtime deals them), 3 processes on 2 cores.
    three = estimate_layout(_llama(6), ParallelConfig(world_size=3, pp=3), _workload(batch=4), prof)
    d = three.decode.pipeline
    assert d.num_microbatches == 3 and three.decode.rows_per_microbatch == 2
    assert three.decode.group_rows == (2, 1, 1)
    # Stage i computes slow_i times slower, slow_i = max(1, n_i / 2 cores) at the number of busy
    # processes it computes beside, n_i = 1 + the others' utilisations u_j = 3 x compute_j / step
    # (a fixed point), fewer than all 3 busy. Row counts do not change the time in this profile.
    alone = [2 * LAYER_WEIGHTS * S4 + 2 * LAYER + HEAD, 2 * LAYER_WEIGHTS * S4 + 2 * LAYER + MIDDLE,
             2 * LAYER_WEIGHTS * S4 + HEAD_WEIGHTS * S8 + 2 * LAYER + LAST]
    slow = [c / a for c, a in zip(d.stage_compute_times_s, alone)]
    util = [3 * c / d.latency_s for c in d.stage_compute_times_s]
    for i in range(3):
        assert slow[i] == pytest.approx(max(1.0, (1 + sum(util) - util[i]) / 2), rel=1e-4)
        assert 1.0 < slow[i] < 1.5
    assert three.tpot_steady_s == pytest.approx(max(sum(d.stage_times_s), 3 * max(d.stage_times_s)))
    # The decode as measured from the first token also holds the later groups' prefill (the fill).
    firsts = three.prefill.first_tokens_s
    assert three.ttft_s == firsts[0] and three.fill_s == pytest.approx(firsts[-1] - firsts[0])
    assert three.fill_s > 0
    assert three.tpot_s == pytest.approx(three.tpot_steady_s + three.fill_s / (8 - 1))
    assert three.decode_bubble_s == pytest.approx(three.tpot_s - sum(d.stage_times_s))


def test_profile_fields_checked():
    with pytest.raises(ValueError, match="quant.q5_k"):
        profile_from_dict(_profile(quant={"q5_k": {"s_per_weight": 1e-9, "flops": 1e9}}))
    with pytest.raises(ValueError, match="field 'flops' must be a positive number"):
        profile_from_dict(_profile(quant={"q4_1": {"s_per_weight": 1e-9, "flops": 0}}))
    with pytest.raises(ValueError, match="field 'layer_s' must be a non-negative number"):
        profile_from_dict(_profile(framework={"engine_s": 1e-4}))
    with pytest.raises(ValueError, match="field 'cores' must be an int >= 1"):
        profile_from_dict(_profile(cores=0))
    with pytest.raises(ValueError, match="weight_quant must be one of"):
        Workload(input_length=1, output_length=1, weight_quant="q3_k")


def test_random_blocks_are_valid_gguf():
    from stagewise import ops
    from stagewise.measure.primitives import random_blocks
    from stagewise.ops import reference

    scale = float(torch.tensor(0.01, dtype=torch.float16))  # the blocks' d, rounded to float16
    for name in ("Q4_1", "Q8_0"):
        q = ops.QTYPES[name]
        w = reference.dequantize(random_blocks(4, 64, q), q)
        assert w.shape == (4, 64) and torch.isfinite(w).all()
        lo, hi = (-0.05, -0.05 + 15 * scale) if name == "Q4_1" else (-128 * scale, 127 * scale)
        assert w.min() >= lo - 1e-4 and w.max() <= hi + 1e-4


def test_validate_reads_the_checkpoints_block_types():
    from stagewise.model.quant import checkpoint_quant
    from stagewise.model.loader import open_checkpoint

    assert checkpoint_quant(open_checkpoint("smollm2-135m")) == ("q4_1", "q8_0")


# --- terms of the runtime measured by the profile: kernel cost by rows, decode attention, groups, fill ---

def test_quantised_linear_cost_by_measured_rows():
    # Measured at 1 and 4 rows: a per-weight and a per-output-row figure each; linear in rows between
    # them, the FMAs at the FMA rate beyond the largest count.
    q = {"s_per_weight": 1e-9, "flops": 1e10, "rows_s_per_weight": {"1": 2e-9, "4": 3e-9},
         "rows_s_per_output": {"1": 0.0, "4": 1e-7}}
    prof = profile_from_dict(_profile(quant={"q4_1": q}))
    prec = compute.Precision(weight=4, act=4, kv=4, compute_dtype="float32", weight_quant="q4_1")
    w, n_out = 128 * 64, 64

    def t(rows: int) -> float:
        return compute.op_time(compute.linear_op("down", prec, tokens=rows, n_in=128, n_out=n_out, layer=0), prof,
                               "float32")[0]

    at1, at4 = w * 2e-9, w * 3e-9 + n_out * 1e-7
    assert t(1) == pytest.approx(at1) and t(4) == pytest.approx(at4)
    assert t(2) == pytest.approx(at1 + (at4 - at1) / 3)
    assert t(10) == pytest.approx(at4 + 2 * 6 * w / 1e10)
    # Without the table: decode once plus the FMAs.
    plain = profile_from_dict(_profile(quant={"q4_1": {"s_per_weight": 1e-9, "flops": 1e10}}))
    op = compute.linear_op("down", prec, tokens=3, n_in=128, n_out=n_out, layer=0)
    assert compute.op_time(op, plain, "float32")[0] == pytest.approx(w * 1e-9 + 2 * 3 * w / 1e10)
    with pytest.raises(ValueError, match="rows_s_per_output must map row counts"):
        profile_from_dict(_profile(quant={"q4_1": {**q, "rows_s_per_output": {"2": 1e-7}}}))


def test_decode_attention_from_the_measured_kernel():
    config = _llama(1)  # 8 query heads, 4 KV heads, head dim 8
    stage = StagePlan.build(1, 1).stages[0]
    attn = {"flops": 1e9, "bandwidth": 2e9, "call_s": 5e-6}
    prof = profile_from_dict(_profile(attention_decode=attn))
    prec = compute.Precision(weight=4, act=4, kv=4, compute_dtype="float32")

    def op(rows, new, ctx):
        ops = compute.stage_ops(config, stage, rows=rows, new_tokens=new, context=ctx, prec=prec)
        return next(o for o in ops if o.name == "attention")

    dec = op(3, 1, 99)  # 3 rows, 100 keys each
    assert dec.decode and dec.cache_bytes == 3 * 100 * 2 * 4 * 8 * 4
    flops = 4 * 8 * 8 * 3 * 100
    assert compute.op_time(dec, prof, "float32")[0] == pytest.approx(5e-6 + flops / 1e9 + dec.cache_bytes / 2e9)
    pre = op(1, 16, 0)  # prefill keeps the roofline (here ~0 with the huge rates)
    assert not pre.decode and compute.op_time(pre, prof, "float32")[0] < 1e-12
    with pytest.raises(ValueError, match="field 'attention_decode'"):
        profile_from_dict(_profile(attention_decode=[1.0]))


def test_groups_dealt_as_the_runtime_deals_them():
    from stagewise.planner.estimate import group_rows

    assert group_rows(4, 3) == [2, 1, 1] and group_rows(5, 2) == [3, 2] and group_rows(6, 3) == [2, 2, 2]
    assert group_rows(1, 1) == [1]


def test_decode_groups_of_different_sizes():
    from stagewise.planner.pipeline import estimate_decode_groups

    # Stage 0 takes 2, 1, 1 for the three groups, stage 1 3, 2, 2; hops 0.1 and 0.2 (tokens back).
    e = estimate_decode_groups([[2.0, 1.0, 1.0], [3.0, 2.0, 2.0]], [0.1, 0.2])
    # Round trip of the largest group 2 + 0.1 + 3 + 0.2 = 5.3; stage 1 busy 7 + 3 x 0.2 = 7.6 a step.
    assert e.latency_s == pytest.approx(7.6) and e.num_microbatches == 3
    assert e.stage_compute_times_s == pytest.approx((4 / 3, 7 / 3))
    assert e.bubble_s == pytest.approx(7.6 - (4 / 3 + 0.1 + 7 / 3 + 0.2))
    same = estimate_decode_groups([[1.0] * 2, [2.0] * 2, [1.0] * 2], [0.1, 0.1, 0.2])
    ref = estimate_decode_steady_state([1.0, 2.0, 1.0], [0.1, 0.1, 0.2], 2)
    assert same.latency_s == pytest.approx(ref.latency_s) and same.stage_times_s == pytest.approx(ref.stage_times_s)
    with pytest.raises(ValueError, match="same number"):
        estimate_decode_groups([[1.0, 1.0], [1.0]], [0.1, 0.1])


def test_fill_drain_pass_matches_the_closed_formula():
    from stagewise.planner.pipeline import estimate_pipeline_runtime_from_stage_times, fill_drain_finish

    st = [1.0, 3.0, 2.0]
    for m in (1, 2, 4):
        done = fill_drain_finish([[t] * m for t in st])
        assert done[0] == pytest.approx(sum(st))  # the first microbatch never waits
        assert done[-1] == pytest.approx(estimate_pipeline_runtime_from_stage_times(st, [0.0] * 3, m).latency_s)
    # Unequal microbatches by hand: stage 0 ends them at 2 and 3; stage 1 at 2 + 1 = 3 and max(3, 3) + 3 = 6.
    assert fill_drain_finish([[2.0, 1.0], [1.0, 3.0]]) == pytest.approx([3.0, 6.0])

"""Planner search space, rank groups, serving YAML, communication, latency and breakdown;
expected values computed by hand from the formulas docs/planner.md states."""

from __future__ import annotations

import pytest

from stagewise.model.config import ModelConfig, MoEConfig
from stagewise.parallel.plan import StagePlan
from stagewise.parallel.ranks import ParallelConfig
from stagewise.planner import compute
from stagewise.planner.estimate import Workload, estimate_layout
from stagewise.planner.pipeline import (
    build_pipeline_send_recv_events,
    estimate_hidden_states_message_bytes,
    estimate_pipeline_runtime_from_stage_times,
    format_breakdowns,
    stage_comm_times,
)
from stagewise.planner.profiles import Link, load_profile, profile_from_dict
from stagewise.planner.search import NoValidLayout, candidate_layouts, resolve_search_sizes, search
from stagewise.planner.serving import load_serving_yaml, parse_serving


def _dense(**kw) -> ModelConfig:
    base = dict(architecture="qwen3", vocab_size=1000, hidden_size=64, num_layers=8, num_heads=8, num_kv_heads=4,
                head_dim=8, intermediate_size=128, qk_norm=True)
    base.update(kw)
    return ModelConfig(**base)


# --- search space ---

def test_resolve_search_sizes_contract():
    assert resolve_search_sizes(None, 8, 1) == [1]  # --pp-sizes not given: PP fixed to 1
    assert resolve_search_sizes([], 8, 1) == [1, 2, 4, 8]  # given without values: powers of two
    assert resolve_search_sizes([], 6, 1) == [1, 2, 4]
    assert resolve_search_sizes([4, 2, 2], 8, 1) == [2, 4]  # explicit values
    assert resolve_search_sizes(None, 8, None) == [1, 2, 4, 8]  # TP is searched by default
    for bad in ([0], [9], [-2]):
        with pytest.raises(ValueError, match="positive integer not greater than --num-devices=8"):
            resolve_search_sizes(bad, 8, 1, "pp-sizes")
    with pytest.raises(ValueError, match="--num-devices must be an int >= 1"):
        resolve_search_sizes(None, 0, 1)


def test_candidate_rules_and_dp_derivation():
    ok, rejected = candidate_layouts(8, [1, 2, 4], [1, 2, 4], [1, 2], [1, 2])
    for lay in ok:
        assert 8 % (lay.tp * lay.pp) == 0 and lay.dp == 8 // (lay.tp * lay.pp)
        assert 8 % lay.ep == 0 and 8 % (lay.ep * lay.moe_dp) == 0 and lay.moe_tp == 8 // (lay.ep * lay.moe_dp)
    assert {(r.tp, r.pp) for r in rejected} == {(4, 4)}  # 16 does not divide 8
    assert "tp * pp = 16 does not divide 8 devices" in rejected[0].reason
    ok6, rej6 = candidate_layouts(6, [1, 2], [1, 3], [1, 4], [1])
    assert {(r.tp, r.pp, r.ep) for r in rej6} == {(1, 1, 4), (1, 3, 4), (2, 1, 4), (2, 3, 4)}
    assert all("ep = 4 does not divide 6" in r.reason for r in rej6)
    assert sorted((x.tp, x.pp, x.dp) for x in ok6) == [(1, 1, 6), (1, 3, 2), (2, 1, 3), (2, 3, 1)]


def test_search_orders_and_rejects_with_reasons():
    config = _dense()
    wl = Workload(input_length=64, output_length=16, batch=4)
    results, rejected = search(config, num_devices=4, workload=wl, profile=load_profile("h100"), pp_sizes=[])
    labels = [r.layout.label() for r in results]
    assert len(labels) == len(set(labels)) == 6  # tp x pp with tp * pp | 4
    assert all(a.tokens_per_s >= b.tokens_per_s for a, b in zip(results, results[1:]))
    assert {(r.tp, r.pp) for r in rejected} == {(2, 4), (4, 2), (4, 4)}
    # The model rejects what it cannot split: 8 heads over 16 ranks, 8 layers over 16 stages.
    with pytest.raises(NoValidLayout, match=r"TP=16 PP=1 EP=1 MOE_DP=1: .*tp=16 must divide num_attention_heads=8"):
        search(config, num_devices=16, workload=wl, profile=load_profile("h100"), tp_sizes=[16])
    with pytest.raises(NoValidLayout, match=r"TP=1 PP=16 EP=1 MOE_DP=1: .*without layers"):
        search(config, num_devices=16, workload=wl, profile=load_profile("h100"), tp_sizes=[1], pp_sizes=[16])
    with pytest.raises(NoValidLayout, match="tp \\* pp = 12 does not divide 8 devices"):
        search(config, num_devices=8, workload=wl, profile=load_profile("h100"), tp_sizes=[3], pp_sizes=[4])


def test_workload_rejects_bad_lengths():
    for kw in (dict(input_length=-1, output_length=4), dict(input_length=4, output_length=0),
               dict(input_length=4, output_length=4, batch=0)):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            Workload(**kw)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        Workload(input_length=4, output_length=4, kv_dtype="int4")


# --- serving YAML and propagation ---

def test_serving_yaml_propagates_to_the_estimate(tmp_path):
    path = tmp_path / "serving.yaml"
    path.write_text("parallel_config:\n  world_size: 8\n  tp_size: 2\n  pp_size: 2\n  dp_size: 2\n")
    serving = load_serving_yaml(path)
    assert serving.parallel == ParallelConfig(world_size=8, tp=2, pp=2, dp=2)
    est = estimate_layout(_dense(), serving.parallel, Workload(input_length=32, output_length=8),
                          load_profile("h100"))
    assert est.plan.num_stages == 2 and est.plan.ranges == [(0, 4), (4, 8)] and est.layout.dp == 2
    assert parse_serving({"parallel_config": {"world_size": 8, "tp_size": 4}}).parallel.dp == 2  # pp 1, dp derived


@pytest.mark.parametrize("text, message", [
    ("parallel_config:\n  world_size: 8\n  tp_size: 2\n  pp_size: 2\n  dp_size: 3\n",
     "world_size=8 must equal tp_size \\* pp_size \\* dp_size = 2 \\* 2 \\* 3 = 12"),
    ("parallel_config: [1, 2]\n", "'parallel_config' must be a mapping"),
    ("parallel_config:\n  world_size: 8\n  tp_size: 0\n", "'tp_size' must be a positive integer"),
    ("parallel_config:\n  world_size: 8\n  tp_size: 3\n", "tp_size \\* pp_size = 3 does not divide world_size=8"),
    ("parallel_config:\n  tp_size: 2\n", "'world_size' is required"),
    ("parallel_config:\n  world_size: 2\n  tp: 2\n", "unknown field"),
    ("parallel_config: {world_size: 8\n", "not valid YAML"),
    ("- 1\n- 2\n", "expected a mapping at the top level"),
])
def test_serving_yaml_errors(tmp_path, text, message):
    path = tmp_path / "serving.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_serving_yaml(path)


# --- rank groups ---

def test_rank_groups_of_world_8_tp_2_pp_4():
    cfg = ParallelConfig(world_size=8, tp=2, pp=4, dp=1)
    pp = cfg.group("pp", 4)
    assert pp.rank_group == (0, 2, 4, 6) and pp.rank_in_group == 2 and pp.world_size == 4
    assert cfg.group("tp", 4).rank_group == (4, 5)
    assert cfg.group("dp", 4).rank_group == (4,)
    assert cfg.groups("pp") == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_rank_groups_with_dp_and_moe():
    cfg = ParallelConfig(world_size=8, tp=2, pp=2, dp=2)  # rank = (dp * 2 + pp) * 2 + tp
    assert cfg.coordinates(5) == {"dp": 1, "pp": 0, "pcp": 0, "tp": 1}
    assert cfg.group("pp", 5).rank_group == (5, 7)
    assert cfg.group("dp", 5).rank_group == (1, 5) and cfg.group("dp", 5).rank_in_group == 1
    assert cfg.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    moe = ParallelConfig(world_size=8, tp=2, pp=2, dp=2, ep=2, moe_dp=2)  # global MoE groups: moe_tp = 2
    assert moe.moe_tp == 2
    assert moe.group("moe_tp", 5).rank_group == (4, 5)
    assert moe.group("ep", 5).rank_group == (5, 7)
    assert moe.group("moe_dp", 5).rank_group == (1, 5)
    with pytest.raises(ValueError, match="world_size=8 must equal tp \\* pcp \\* pp \\* dp = 2 \\* 1 \\* 2 \\* 1 = 4"):
        ParallelConfig(world_size=8, tp=2, pp=2, dp=1)
    with pytest.raises(ValueError, match="rank must be an int in \\[0, 8\\)"):
        cfg.group("tp", 8)


# --- communication ---

def test_message_bytes_and_comm_by_stage_position():
    assert estimate_hidden_states_message_bytes(128, 4096, 2) == 1_048_576
    with pytest.raises(ValueError, match="num_tokens must be an int >= 0"):
        estimate_hidden_states_message_bytes(-1, 4096, 2)
    link = Link(latency_s=1e-5, bandwidth=1e9)
    events = build_pipeline_send_recv_events(4, 1_000_000, link)
    assert [(e.src_stage, e.dst_stage) for e in events] == [(0, 1), (1, 2), (2, 3)]
    one_way = 1e-5 + 1_000_000 / 1e9
    assert events[0].latency_s == pytest.approx(one_way)
    comm = stage_comm_times(4, events)
    assert comm[0] == (0.0, pytest.approx(one_way))  # first: outgoing only
    assert comm[1] == comm[2] == (pytest.approx(one_way), pytest.approx(one_way))  # middle: both
    assert comm[3] == (pytest.approx(one_way), 0.0)  # last: incoming only
    assert stage_comm_times(1, build_pipeline_send_recv_events(1, 10**6, link)) == [(0.0, 0.0)]  # pp = 1
    assert stage_comm_times(3, build_pipeline_send_recv_events(3, 0, link)) == [(0.0, 0.0)] * 3  # no bytes


def test_pp_comm_in_the_estimate_uses_the_pp_link():
    prof = load_profile("h100")
    config = _dense()
    wl = Workload(input_length=100, output_length=10, batch=1)
    est = estimate_layout(config, ParallelConfig(world_size=2, pp=2), wl, prof)
    one_way = prof.links["pp"].latency_s + 100 * 64 * 2 / prof.links["pp"].bandwidth
    assert est.prefill.pipeline.stage_comm_times_s == (pytest.approx(one_way), pytest.approx(one_way))
    single = estimate_layout(config, ParallelConfig(world_size=1), wl, prof)
    assert single.prefill.pipeline.stage_comm_times_s == (0.0,) and single.decode.pipeline.bubble_s == 0.0


# --- latency, microbatches, bubble ---

def test_fill_drain_latency_and_bubble():
    est = estimate_pipeline_runtime_from_stage_times([1.0, 2.0, 1.0], [0.1, 0.2, 0.1], 3)
    assert est.stage_times_s == pytest.approx((1.1, 2.2, 1.1))
    assert est.latency_s == pytest.approx(4.4 + 2 * 2.2)
    assert est.bubble_s == pytest.approx(4.4)
    assert est.breakdown() == pytest.approx({"compute": 4.0, "communication": 0.4, "bubble": 4.4})
    one = estimate_pipeline_runtime_from_stage_times([1.0, 2.0, 1.0], [0.1, 0.2, 0.1], 1)
    assert one.latency_s == pytest.approx(4.4) and one.bubble_s == 0.0  # one microbatch: no bubble
    with pytest.raises(ValueError, match="num_microbatches must be an int >= 1"):
        estimate_pipeline_runtime_from_stage_times([1.0], [0.0], 0)


def test_microbatches_default_to_min_batch_pp():
    prof, config = load_profile("h100"), _dense()
    est = estimate_layout(config, ParallelConfig(world_size=4, pp=4), Workload(input_length=8, output_length=4,
                                                                                  batch=3), prof)
    assert est.decode.pipeline.num_microbatches == 3 and est.decode.rows_per_microbatch == 1
    d = est.decode.pipeline
    # Decode steady state: 3 groups cycle through 4 stages; a step is the round trip or 3 x the busiest.
    assert d.latency_s == pytest.approx(max(sum(d.stage_times_s), 3 * max(d.stage_times_s)))
    link = prof.links["pp"]
    hop, back = link.latency_s + 64 * 2 / link.bandwidth, link.latency_s + 8 / link.bandwidth  # 1 row each
    assert d.stage_comm_times_s == pytest.approx((hop, hop, hop, back))  # the last stage sends tokens to stage 0
    # Prefill, fill-drain with equal microbatches: the first leaves the last stage after sum(stage_times),
    # the last after sum + 2 x max; TTFT is the first's tokens back on stage 0.
    st = est.prefill.pipeline.stage_times_s
    assert est.prefill.pipeline.latency_s == pytest.approx(sum(st) + 2 * max(st))
    assert est.ttft_s == pytest.approx(sum(st) + back)
    assert est.prefill.first_tokens_s[-1] == pytest.approx(est.prefill.pipeline.latency_s + back)
    # TPOT as measured from the first token: the steady step plus the fill (2 x max) over the 3 steps.
    assert est.tpot_steady_s == d.latency_s
    assert est.tpot_s == pytest.approx(d.latency_s + 2 * max(st) / 3)
    assert est.tokens_per_s == pytest.approx(3 * 4 / (est.ttft_s + 3 * est.tpot_s))


def test_breakdown_line_shares():
    line = format_breakdowns({"mem": 1.0, "comm": 1.0, "cube": 2.0, "vec": 0.0},
                             {"compute": 3.0, "communication": 1.0, "bubble": 2.0})
    assert line == "Mem 25.00 | Comm 25.00 | Cube 50.00 | Vec 0.00 | PP Compute 50.00 | PP Comm 16.67 | PP Bubble 33.33"


# --- per-operator compute model ---

def test_attention_grows_with_context_and_moe_counts_active_experts():
    config = _dense(num_layers=1)
    stage = StagePlan.build(1, 1).stages[0]

    def attn(ops):
        return next(o for o in ops if o.name == "attention")

    short = attn(compute.stage_ops(config, stage, rows=1, new_tokens=1, context=99))
    long = attn(compute.stage_ops(config, stage, rows=1, new_tokens=1, context=999))
    # 4 * heads * head_dim FLOPs per query-key pair; 100 and 1000 keys.
    assert short.flops == 4 * 8 * 8 * 100 and long.flops == 4 * 8 * 8 * 1000
    prefill = attn(compute.stage_ops(config, stage, rows=2, new_tokens=10, context=0))
    assert prefill.flops == 4 * 8 * 8 * 2 * 55  # causal: 1 + 2 + ... + 10 pairs per row
    windowed = attn(compute.stage_ops(_dense(num_layers=1, architecture="llama", sliding_window=4), stage,
                                      rows=1, new_tokens=1, context=999))
    assert windowed.flops == 4 * 8 * 8 * 4
    moe = _dense(num_layers=1, architecture="qwen3_moe",
                 moe=MoEConfig(num_experts=16, num_experts_per_tok=2, intermediate_size=32))
    experts = next(o for o in compute.stage_ops(moe, stage, rows=1, new_tokens=5, context=0) if o.name == "experts")
    assert experts.flops == 2 * 5 * 2 * 3 * 64 * 32  # 5 tokens x 2 active experts x 3 matrices
    # Weight bytes: the expected share of experts 5 tokens x 2 picks touch, 2 bytes each.
    touched = 1 - (1 - 2 / 16) ** 5
    assert experts.bytes == pytest.approx(touched * 16 * 3 * 64 * 32 * 2 + 5 * 2 * (2 * 64 + 3 * 32) * 2)


def test_tp_adds_two_all_reduces_per_layer_and_one_for_the_embedding_and_roofline():
    config = _dense(num_layers=3)
    stage = StagePlan.build(3, 1).stages[0]
    ops = compute.stage_ops(config, stage, rows=1, new_tokens=4, context=0,
                            sharding=__import__("stagewise.model.shapes", fromlist=["Sharding"]).Sharding(tp=2))
    reduces = [o for o in ops if o.name.endswith("all_reduce")]
    assert len(reduces) == 2 * 3 + 1 and all(o.bytes == 4 * 64 * 2 and o.group == 2 for o in reduces)
    prof = profile_from_dict({"name": "t", "memory_bytes": 1e9, "peak_flops": {"bfloat16": 1e12},
                              "memory_bandwidth": 1e11, "op_overhead_s": 1e-6,
                              "links": {k: {"latency_s": 2e-6, "bandwidth": 1e10} for k in ("tp", "pp", "ep")}})
    t, bound = compute.op_time(reduces[0], prof, "bfloat16")
    assert bound == "comm" and t == pytest.approx(2 * 1 / 2 * 512 / 1e10 + 2 * 1 * 2e-6 + 1e-6)
    t, bound = compute.op_time(compute.Op("x", "matmul", flops=2e9, bytes=1e6), prof, "bfloat16")
    assert bound == "cube" and t == pytest.approx(2e-3 + 1e-6)
    t, bound = compute.op_time(compute.Op("x", "matmul", flops=2e6, bytes=1e9), prof, "bfloat16")
    assert bound == "mem" and t == pytest.approx(1e-2 + 1e-6)


def test_profiles_builtin_and_bad():
    for name in ("h100-sxm", "h200", "a100", "cpu-generic"):
        p = load_profile(name)
        assert p.memory_bytes > 0 and p.flops("bf16") > 0 and set(p.links) == {"tp", "pp", "ep"}
    with pytest.raises(ValueError, match="neither a built-in profile"):
        load_profile("tpu-v9")
    with pytest.raises(ValueError, match="field 'memory_bandwidth' must be a positive number"):
        profile_from_dict({"name": "x", "memory_bytes": 1, "peak_flops": {"float32": 1}, "memory_bandwidth": -1,
                           "op_overhead_s": 0, "links": {k: {"latency_s": 0, "bandwidth": 1} for k in ("tp", "pp", "ep")}})
    with pytest.raises(ValueError, match="transport 'shm' was not measured"):
        load_profile("h100").with_transport("shm")


def test_image_tokens_add_the_vision_tower_to_the_prefill_of_stage_0():
    """``--image-tokens N``: the ViT's matmuls over N * merge^2 patches (2 FLOPs per weight per
    patch, the mergers per merged token) and its attention, on stage 0's prefill only."""
    from stagewise.model.hf_config import parse_config_file
    from stagewise.model.shapes import count, vision_tensors
    from stagewise.planner.models import MODELS_DIR

    cfg = parse_config_file(MODELS_DIR / "qwen3-vl-235b-a22b.json")
    v = cfg.vision_config
    ops = compute.vision_ops(cfg, images=1, image_tokens=256, prec=compute.Precision())
    patches = 256 * v.spatial_merge_size**2
    matmul = sum(o.flops for o in ops if o.kind == "matmul")
    linears = [t for t in vision_tensors(cfg) if t.kind in ("linear", "conv")]
    on_patches = count(cfg, [t for t in linears if "merger" not in t.name])
    on_tokens = count(cfg, [t for t in linears if "merger" in t.name])  # the mergers: once per merged token
    assert matmul == 2 * patches * on_patches + 2 * 256 * on_tokens
    plan = StagePlan.for_model(cfg, 4, "even")
    first, later = plan.stages[0], plan.stages[1]
    kw = dict(rows=1, context=0, prec=compute.Precision())
    assert compute.stage_ops(cfg, first, new_tokens=300, image_tokens=256, **kw)[:len(ops)] == ops
    assert not any(o.name.startswith("vit") for o in compute.stage_ops(cfg, later, new_tokens=300, image_tokens=256,
                                                                        **kw))
    assert not any(o.name.startswith("vit") for o in compute.stage_ops(cfg, first, new_tokens=1, image_tokens=256,
                                                                        **kw))
    profile = load_profile("h100-sxm")
    layout = ParallelConfig(world_size=32, tp=8, pp=4)
    text, image = (estimate_layout(cfg, layout, Workload(input_length=2048, output_length=64, image_tokens=n), profile)
                   for n in (0, 1024))
    assert image.ttft_s > text.ttft_s and image.tpot_steady_s == text.tpot_steady_s
    with pytest.raises(ValueError, match="image_tokens"):
        Workload(input_length=10, output_length=1, image_tokens=11)


def test_a_prefix_share_prices_the_prefill_of_the_uncached_tokens_over_the_whole_prompt():
    """A prompt whose first 1,536 of 2,048 tokens are cached: its prefill computes 512 new tokens
    attending over the 1,536 cached ones (cheaper than the whole prompt, dearer than 512 alone);
    decode, memory and the KV per sequence do not change. The share is checked and reported."""
    from stagewise.planner.models import resolve_model

    config, layout, profile = resolve_model("qwen3-4b")[0], ParallelConfig(world_size=1), load_profile("h100-sxm")
    whole, cached = (estimate_layout(config, layout, Workload(input_length=2048, output_length=64, prefix_share=s),
                                     profile) for s in (0.0, 0.75))
    alone = estimate_layout(config, layout, Workload(input_length=512, output_length=64), profile)
    assert alone.ttft_s < cached.ttft_s < whole.ttft_s and cached.ttft_s < 0.5 * whole.ttft_s
    assert cached.tpot_s == pytest.approx(whole.tpot_s, rel=0.05)
    assert cached.memory_per_rank == whole.memory_per_rank and cached.kv_bytes_per_rank == whole.kv_bytes_per_rank
    assert Workload(input_length=10, output_length=1, prefix_share=1.0).cached_tokens == 9
    with pytest.raises(ValueError, match="prefix_share must be a number in"):
        Workload(input_length=10, output_length=1, prefix_share=1.5)
    with pytest.raises(ValueError, match="'prefix_share' must be a number in"):
        parse_serving({"parallel_config": {"world_size": 1}, "prefix_share": -0.1})
    assert parse_serving({"parallel_config": {"world_size": 1}, "prefix_share": 0.5}).prefix_share == 0.5


def test_speculative_decoding_prices_a_step_of_k_plus_one_tokens_per_row_and_its_expected_yield():
    """K drafts at acceptance a: a decode step runs 1 + K tokens a row (dearer than one, far less
    than 1 + K steps on a GPU where decode reads the weights once) and yields (1 - a^(K+1)) / (1 - a)
    tokens; the TPOT is the step over that yield. The prefill does not change."""
    from stagewise.planner.models import resolve_model

    config, layout, profile = resolve_model("qwen3-4b")[0], ParallelConfig(world_size=1), load_profile("h100-sxm")
    plain = estimate_layout(config, layout, Workload(input_length=512, output_length=64), profile)
    w = Workload(input_length=512, output_length=64, speculative_tokens=3, acceptance=0.6)
    spec = estimate_layout(config, layout, w, profile)
    assert w.tokens_per_step == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    step, one = spec.decode.pipeline.latency_s, plain.decode.pipeline.latency_s
    assert one < step < 1.5 * one and spec.decode.new_tokens == 4
    assert spec.tpot_steady_s == pytest.approx(step / w.tokens_per_step) and spec.tpot_s < plain.tpot_s
    assert spec.ttft_s == plain.ttft_s
    assert Workload(input_length=8, output_length=8, speculative_tokens=2, acceptance=1.0).tokens_per_step == 3
    with pytest.raises(ValueError, match="speculative_tokens must be an int >= 0"):
        Workload(input_length=8, output_length=8, speculative_tokens=2, acceptance=1.5)

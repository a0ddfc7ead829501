"""Planner context parallel: KV per rank over pcp * dcp ranks, the decode and prefill
collectives written out by hand, PCP halving the prefill work, refused DCP sizes and the CLI."""

from __future__ import annotations

import json

import pytest

from stagewise.model import shapes
from stagewise.model.config import ModelConfig
from stagewise.model.hf_config import parse_config_file
from stagewise.parallel.plan import StagePlan
from stagewise.parallel.ranks import ParallelConfig
from stagewise.planner import cli, compute, memory
from stagewise.planner.estimate import Workload, estimate_layout
from stagewise.planner.models import MODELS_DIR
from stagewise.planner.profiles import load_profile, profile_from_dict
from stagewise.planner.search import NoValidLayout, candidate_layouts, search

QWEN3_4B = MODELS_DIR / "qwen3-4b.json"  # the same file as shared/configs/qwen3-4b.json


def _qwen3_4b() -> ModelConfig:
    config = parse_config_file(QWEN3_4B)
    # The figures the hand computations below use.
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (36, 32, 8, 128)
    return config


def _tiny(**kw) -> ModelConfig:
    """8 query heads and 2 KV heads of 8: at tp=4 each rank has 2 query heads and one KV head,
    which 2 ranks hold (so dcp=2 is valid there)."""
    base = dict(architecture="qwen3", vocab_size=100, hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=2,
                head_dim=8, intermediate_size=64, qk_norm=True)
    base.update(kw)
    return ModelConfig(**base)


def _comm(ops: list[compute.Op], layer: int = 0) -> list[tuple[str, float, int, str, str]]:
    return [(o.name, o.bytes, o.group, o.collective, o.link) for o in ops if o.kind == "comm" and o.layer == layer]


def _op(ops: list[compute.Op], name: str, layer: int = 0) -> compute.Op:
    [op] = [o for o in ops if o.name == name and o.layer == layer]
    return op


# --- memory -----------------------------------------------------------------------------------

@pytest.mark.parametrize("tp, dcp, pcp", [(16, 1, 1), (16, 2, 1), (16, 1, 2), (16, 2, 2), (16, 1, 3), (32, 4, 1)])
def test_kv_per_rank_falls_by_pcp_times_dcp(tp, dcp, pcp):
    config = _qwen3_4b()
    tokens, batch = 1001, 3
    # One KV head per rank beyond tp=8 (8 KV heads): 2 (K, V) * 1 head * 128 * 2 bytes per token and layer.
    per_token_layer = 2 * max(1, 8 // tp) * 128 * 2
    expected = 36 * per_token_layer * batch * -(-tokens // (pcp * dcp))
    sharding = shapes.Sharding(tp=tp, dcp=dcp, pcp=pcp)
    [stage] = memory.stage_memory(config, StagePlan.for_model(config, 1), tokens=tokens, batch=batch,
                                  sharding=sharding)
    assert stage.kv_bytes == expected
    # Weights are the TP shard whatever pcp and dcp are.
    [plain] = memory.stage_memory(config, StagePlan.for_model(config, 1), tokens=tokens, batch=batch,
                                  sharding=shapes.Sharding(tp=tp))
    assert stage.weight_bytes_exact == plain.weight_bytes_exact
    assert -(-plain.kv_bytes // (pcp * dcp)) <= stage.kv_bytes < plain.kv_bytes // (pcp * dcp) + 36 * per_token_layer * 3


def test_estimate_reports_the_sharded_kv():
    config = _qwen3_4b()
    wl = Workload(input_length=500, output_length=100, batch=2)
    prof = load_profile("h100")
    plain = estimate_layout(config, ParallelConfig(world_size=16, tp=16), wl, prof)
    dcp = estimate_layout(config, ParallelConfig(world_size=16, tp=16, dcp=2), wl, prof)
    both = estimate_layout(config, ParallelConfig(world_size=32, tp=16, pcp=2, dcp=2), wl, prof)
    assert plain.kv_bytes_per_rank == 36 * 512 * 2 * 600
    assert dcp.kv_bytes_per_rank == 36 * 512 * 2 * 300 and both.kv_bytes_per_rank == 36 * 512 * 2 * 150
    assert dcp.weight_bytes_per_rank == plain.weight_bytes_per_rank == both.weight_bytes_per_rank
    d = both.to_dict()
    assert (d["pcp"], d["dcp"], d["parallel"]) == (2, 2, "TP=16 | PP=1 | DP=1 | PCP=2 | DCP=2")


def test_sharding_validates_the_context_parallel_sizes():
    assert shapes.Sharding(tp=4, dcp=2, pcp=3).pcp == 3
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"Sharding\.dcp: expected an int >= 1"):
            shapes.Sharding(dcp=bad)
        with pytest.raises(ValueError, match=r"Sharding\.pcp: expected an int >= 1"):
            shapes.Sharding(pcp=bad)
    config = _tiny()
    table = shapes.model_tensors(config)
    assert shapes.count(config, table, shapes.Sharding(tp=4, dcp=2, pcp=2)) == \
        shapes.count(config, table, shapes.Sharding(tp=4))


def test_invalid_dcp_is_a_clear_error_naming_valid_sizes():
    config = _qwen3_4b()  # 8 KV heads: at tp=4 every rank holds its own 2, no copies to shard
    with pytest.raises(ValueError, match="dcp=2 at tp=4.*valid dcp sizes at tp=4: 1$"):
        memory.check_layout(config, shapes.Sharding(tp=4, dcp=2))
    with pytest.raises(ValueError, match="valid dcp sizes at tp=16: 1, 2$"):
        memory.stage_memory(config, StagePlan.for_model(config, 1), tokens=8, sharding=shapes.Sharding(tp=16, dcp=4))
    wl, prof = Workload(input_length=16, output_length=4), load_profile("h100")
    with pytest.raises(ValueError, match="valid dcp sizes at tp=4: 1"):
        estimate_layout(config, ParallelConfig(world_size=4, tp=4, dcp=2), wl, prof)
    with pytest.raises(NoValidLayout, match=r"TP=4 PP=1 DCP=2 EP=1 MOE_DP=1: .*valid dcp sizes at tp=4: 1"):
        search(config, num_devices=4, workload=wl, profile=prof, tp_sizes=[4], dcp_sizes=[2])


# --- the search space ---------------------------------------------------------------------------

def test_candidates_with_pcp_and_dcp_and_the_unchanged_default():
    ok, rejected = candidate_layouts(8, [1, 2, 4], [1, 2], [1], [1], pcp_sizes=[1, 2], dcp_sizes=[1, 2])
    got = {(c.tp, c.pp, c.pcp, c.dcp, c.dp) for c in ok}
    assert (4, 1, 2, 2, 1) in got and (2, 2, 2, 1, 1) in got and (4, 2, 1, 2, 1) in got
    assert all(c.tp * c.pcp * c.pp * c.dp == 8 and c.tp % c.dcp == 0 for c in ok)
    assert any(r.tp == 1 and r.dcp == 2 and "dcp = 2 does not divide tp = 1" in r.reason for r in rejected)
    assert any(r.tp == 4 and r.pp == 2 and r.pcp == 2 and "tp * pcp * pp = 16 does not divide 8" in r.reason
               for r in rejected)
    default, _ = candidate_layouts(8, [1, 2], [1, 2], [1], [1])
    assert {(c.pcp, c.dcp) for c in default} == {(1, 1)}
    results, _ = search(_qwen3_4b(), num_devices=4, workload=Workload(input_length=16, output_length=4),
                        profile=load_profile("h100"))
    assert {(r.layout.pcp, r.layout.dcp) for r in results} == {(1, 1)}


# --- decode ---------------------------------------------------------------------------------------

def _profile():
    return profile_from_dict({"name": "t", "memory_bytes": 1e9, "peak_flops": {"bfloat16": 1e12},
                              "memory_bandwidth": 1e11, "op_overhead_s": 1e-6,
                              "links": {k: {"latency_s": 2e-6, "bandwidth": 1e10} for k in ("tp", "pp", "ep")}})


def test_decode_collectives_at_tp4_dcp2_by_hand():
    config = _tiny()
    stage = StagePlan.build(2, 1).stages[0]
    rows, context = 3, 99  # 100 keys per row
    ops = compute.stage_ops(config, stage, rows=rows, new_tokens=1, context=context,
                            sharding=shapes.Sharding(tp=4, dcp=2))
    # T = 3 tokens, 2 query heads of 8 per rank, bf16 activations (2 bytes), fp32 partials (4 bytes).
    q_gathered = 2 * 3 * 2 * 8 * 2          # dcp * T * hq_rank * d * act: each rank puts in 3 * 2 * 8 * 2
    part = 3 * 4 * (8 * 2 + 4)              # one rank's partial outputs (bf16) and fp32 LSEs: the group's 4 heads
    partials = 2 * part                     # all-gathered over the DCP pair
    all_reduce = 3 * 32 * 2                 # T * hidden * act, as without DCP
    assert _comm(ops) == [("q_all_gather", q_gathered, 2, "all_gather", "tp"),
                          ("partials_all_gather", partials, 2, "all_gather", "tp"),
                          ("attn_all_reduce", all_reduce, 4, "all_reduce", "tp"),
                          ("mlp_all_reduce", all_reduce, 4, "all_reduce", "tp")]
    # the stage's ends: the vocab-parallel embedding's all-reduce, the logits gathered to the leader
    assert _comm(ops, None) == [("embedding_all_reduce", all_reduce, 4, "all_reduce", "tp"),
                                ("logits_gather", 3 * 25 * 4 * 4, 4, "all_gather", "tp")]
    attn = _op(ops, "attention")
    # The 4 query heads of the DCP group over ceil(100 / 2) = 50 keys of the rank's one KV head.
    assert attn.flops == 4 * (2 * 2) * 8 * (3 * 50)
    assert attn.cache_bytes == 3 * 50 * 2 * 1 * 8 * 2 and attn.bytes == attn.cache_bytes + 2 * 3 * 4 * 8 * 2
    assert _op(ops, "kv_write").bytes == 3 * 2 * 1 * 8 * (2 + 2) / 2  # the new token on one of the 2 ranks

    with_pcp = compute.stage_ops(config, stage, rows=rows, new_tokens=1, context=context,
                                 sharding=shapes.Sharding(tp=4, dcp=2, pcp=2))
    names = [c[0] for c in _comm(with_pcp)]
    assert names == ["q_all_gather", "partials_all_gather", "partials_pcp_all_gather", "attn_all_reduce",
                     "mlp_all_reduce"]
    pcp_gather = _op(with_pcp, "partials_pcp_all_gather")  # the 2 x 2 ranks' parts, over the PCP pair
    assert (pcp_gather.bytes, pcp_gather.group, pcp_gather.collective) == (4 * part, 2, "all_gather")
    assert _op(with_pcp, "attention").cache_bytes == 3 * 25 * 2 * 1 * 8 * 2  # ceil(100 / 4) keys
    # The linears are the same work on every PCP rank in decode.
    assert _op(with_pcp, "qkv_proj").flops == _op(ops, "qkv_proj").flops

    # Timing: all-gather / reduce-scatter (n - 1) / n * bytes / bw + (n - 1) * latency; all-reduce as before.
    prof = _profile()
    t, bound = compute.op_time(_op(ops, "q_all_gather"), prof, "bfloat16")
    assert bound == "comm" and t == pytest.approx(1 / 2 * q_gathered / 1e10 + 1 * 2e-6 + 1e-6)
    t, _ = compute.op_time(_op(ops, "partials_all_gather"), prof, "bfloat16")
    assert t == pytest.approx(1 / 2 * partials / 1e10 + 1 * 2e-6 + 1e-6)
    t, _ = compute.op_time(_op(ops, "attn_all_reduce"), prof, "bfloat16")
    assert t == pytest.approx(2 * 3 / 4 * all_reduce / 1e10 + 2 * 3 * 2e-6 + 1e-6)


def test_without_context_parallel_nothing_changes():
    config = _tiny()
    stage = StagePlan.build(2, 1).stages[0]
    for new_tokens, context in ((1, 40), (17, 0)):
        ops = compute.stage_ops(config, stage, rows=2, new_tokens=new_tokens, context=context,
                                sharding=shapes.Sharding(tp=4))
        assert [c[0] for c in _comm(ops)] == ["attn_all_reduce", "mlp_all_reduce"]
        assert _op(ops, "kv_write").bytes == 2 * new_tokens * 2 * 1 * 8 * 4


# --- prefill --------------------------------------------------------------------------------------

def test_prefill_flops_halve_at_pcp2_and_its_gathers():
    config = _qwen3_4b()
    stage = StagePlan.for_model(config, 1).stages[0]
    rows, prompt = 2, 1001
    one = compute.stage_ops(config, stage, rows=rows, new_tokens=prompt, context=0)
    two = compute.stage_ops(config, stage, rows=rows, new_tokens=prompt, context=0,
                            sharding=shapes.Sharding(pcp=2))

    def layer_flops(ops):
        return sum(o.flops for o in ops if o.layer is not None)

    # ceil(1001 / 2) = 501 of each prompt per rank: half the work, up to that rounding.
    ratio = layer_flops(two) / layer_flops(one)
    assert 0.5 <= ratio <= 501 / 1001
    assert _op(two, "qkv_proj").flops == _op(one, "qkv_proj").flops * 501 / 1001
    pairs = rows * prompt * (prompt + 1) // 2  # causal query-key pairs of the two prompts
    assert _op(one, "attention").flops == 4 * 32 * 128 * pairs
    assert _op(two, "attention").flops == 4 * 32 * 128 * -(-pairs // 2)
    # Per layer, K and V of the whole prompts gathered over the 2 PCP ranks; after the stage, the hidden states.
    kv = _op(two, "kv_all_gather")
    assert (kv.bytes, kv.group, kv.collective, kv.link) == (2 * rows * prompt * 8 * 128 * 2, 2, "all_gather", "tp")
    [hidden] = [o for o in two if o.name == "hidden_all_gather"]
    assert (hidden.bytes, hidden.group, hidden.collective) == (rows * prompt * 2560 * 2, 2, "all_gather")
    assert sum(o.name == "kv_all_gather" for o in two) == 36
    assert not any(o.kind == "comm" for o in one)

    # DCP alone leaves the prefill's work as it is (every DCP rank holds its KV head's prompt).
    tp16 = compute.stage_ops(config, stage, rows=rows, new_tokens=prompt, context=0, sharding=shapes.Sharding(tp=16))
    dcp2 = compute.stage_ops(config, stage, rows=rows, new_tokens=prompt, context=0,
                             sharding=shapes.Sharding(tp=16, dcp=2))
    assert layer_flops(dcp2) == layer_flops(tp16)
    assert [c[0] for c in _comm(dcp2)] == [c[0] for c in _comm(tp16)]


def test_pcp_speeds_up_the_prefill_of_a_long_prompt():
    config = _qwen3_4b()
    wl = Workload(input_length=8192, output_length=16, batch=1)
    prof = load_profile("h100")
    plain = estimate_layout(config, ParallelConfig(world_size=1), wl, prof)
    pcp = estimate_layout(config, ParallelConfig(world_size=2, pcp=2), wl, prof)
    assert pcp.ttft_s < 0.7 * plain.ttft_s
    assert pcp.prefill.op_bound["comm"] > 0 and plain.prefill.op_bound["comm"] == 0


# --- CLI ------------------------------------------------------------------------------------------

def test_plan_memory_dcp(capsys):
    argv = ["memory", str(QWEN3_4B), "--stages", "1", "--tp", "16", "--max-ctx", "1001", "--batch", "3"]
    assert cli.main([*argv, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main([*argv, "--dcp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["tp"], data["dcp"], data["pcp"]) == (16, 2, 1)
    [stage] = data["plans"][0]["stages"]
    assert stage["kv_bytes"] == 36 * 512 * 3 * 501
    assert stage["weight_bytes_exact"] == plain["plans"][0]["stages"][0]["weight_bytes_exact"]
    assert cli.main([*argv, "--dcp", "2"]) == 0
    out = capsys.readouterr().out
    assert "one of 16 TP ranks, each sequence's KV spread over pcp x dcp = 1 x 2 ranks" in out
    assert f"{36 * 512 * 3 * 501:,}" in out

    assert cli.main(["memory", str(QWEN3_4B), "--stages", "1", "--tp", "4", "--dcp", "2"]) == 2
    assert "valid dcp sizes at tp=4: 1" in capsys.readouterr().err
    assert cli.main(["memory", str(QWEN3_4B), "--stages", "1", "--pcp", "0"]) == 2
    assert "--dcp, --pcp" in capsys.readouterr().err


def test_plan_search_dcp_sizes(capsys):
    argv = ["qwen3-4b", "--num-devices", "16", "--tp-sizes", "16", "--dcp-sizes", "1", "2",
            "--input-length", "500", "--output-length", "100", "--batch", "2"]
    assert cli.main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["dcp"]: r for r in data["layouts"]}
    assert set(rows) == {1, 2} and all(r["pcp"] == 1 and r["tp"] == 16 for r in rows.values())
    assert rows[2]["parallel"] == "TP=16 | PP=1 | DP=1 | DCP=2"
    assert rows[1]["kv_bytes_per_rank"] == 36 * 512 * 2 * 600 == 2 * rows[2]["kv_bytes_per_rank"]
    assert rows[2]["confidence"]["validated"] is False
    assert "TP=16 outside validated 1..2" in rows[2]["confidence"]["not_validated_because"]  # the record's TP
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "TP=16 | PP=1 | DP=1 | DCP=2" in out and "TP=16 | PP=1 | DP=1 " in out

    # PCP takes ranks of its own: at 8 devices, tp 4 x pcp 2 is one replica.
    assert cli.main(["qwen3-4b", "--num-devices", "8", "--tp-sizes", "4", "--pcp-sizes", "1", "2",
                     "--input-length", "64", "--output-length", "8", "--json"]) == 0
    got = {(r["pcp"], r["dp"]) for r in json.loads(capsys.readouterr().out)["layouts"]}
    assert got == {(1, 2), (2, 1)}
    assert cli.main(["qwen3-4b", "--num-devices", "4", "--tp-sizes", "4", "--dcp-sizes", "2"]) == 2
    assert "valid dcp sizes at tp=4: 1" in capsys.readouterr().err


def test_serving_yaml_takes_pcp_and_dcp():
    from stagewise.planner.serving import parse_serving

    pc = {"world_size": 32, "tp_size": 16, "pcp_size": 2, "dcp_size": 2}
    assert parse_serving({"parallel_config": pc}).parallel == ParallelConfig(world_size=32, tp=16, pcp=2, dcp=2)
    with pytest.raises(ValueError, match=r"tp_size \* pcp_size \* pp_size = 48 does not divide world_size=32"):
        parse_serving({"parallel_config": {**pc, "pcp_size": 3}})
    with pytest.raises(ValueError, match=r"= 16 \* 2 \* 1 \* 2 = 64"):
        parse_serving({"parallel_config": {**pc, "dp_size": 2}})
    with pytest.raises(ValueError, match="dcp=3 must divide tp=16"):
        parse_serving({"parallel_config": {**pc, "dcp_size": 3}})


# --- measured collectives and the DCP combine ------------------------------------------------------

def test_a_measured_tp_link_times_each_collective_by_its_table():
    """A CPU profile's TP link measured for groups of 2 (as `bench profile` records it): each
    collective of a 2-rank group takes its measured time at its per-rank bytes (between the sizes:
    linear; below: the smallest's); other group sizes keep the ring formulas."""
    tables = {"ranks": 2, "all_reduce_s": {"1000": 40e-6, "3000": 60e-6}, "all_gather_s": {"1000": 30e-6, "3000": 50e-6}}
    d = {"name": "t", "memory_bytes": 1e9, "peak_flops": {"bfloat16": 1e12}, "memory_bandwidth": 1e11,
         "op_overhead_s": 1e-6,
         "links": {"tp": {"latency_s": 2e-6, "bandwidth": 1e10, "collectives": tables},
                   "pp": {"latency_s": 2e-6, "bandwidth": 1e10}, "ep": {"latency_s": 2e-6, "bandwidth": 1e10}}}
    profile = profile_from_dict(d)

    def t(name, nbytes, group, collective):
        return compute.op_time(compute.Op(name, "comm", 0, nbytes, 0, "tp", group, collective=collective),
                               profile, "bfloat16")[0]

    assert t("ar", 2000, 2, "all_reduce") == pytest.approx(50e-6)
    assert t("rs", 500, 2, "reduce_scatter") == pytest.approx(40e-6)
    assert t("ag", 2 * 2000, 2, "all_gather") == pytest.approx(40e-6)       # gathered 4000 = 2000 per rank
    assert t("ag", 2 * 5000, 2, "all_gather") == pytest.approx(70e-6)       # past the table: its last slope
    ring = 2 * 3 / 4 * 2000 / 1e10 + 2 * 3 * 2e-6 + 1e-6
    assert t("ar", 2000, 4, "all_reduce") == pytest.approx(ring)
    with pytest.raises(ValueError, match="collectives.ranks"):
        profile_from_dict({**d, "links": {**d["links"], "tp": {**d["links"]["tp"],
                                                               "collectives": {**tables, "ranks": 1}}}})


def test_the_dcp_combine_is_priced_per_decode_layer():
    base = {"name": "c", "kind": "cpu", "memory_bytes": 1e10, "peak_flops": {"float32": 1e12},
            "memory_bandwidth": 1e11, "op_overhead_s": 1e-6,
            "links": {k: {"latency_s": 2e-6, "bandwidth": 1e10} for k in ("tp", "pp", "ep")},
            "framework": {"layer_s": 1e-5, "python_layer_s": 2e-5, "engine_s": 1e-4, "head_s": 1e-4, "middle_s": 1e-4,
                          "last_s": 1e-4, "tokens_s": 1e-5}}
    without = profile_from_dict(base)
    with_cp = profile_from_dict({**base, "framework": {**base["framework"], "cp_layer_s": 7e-5}})
    assert compute.framework_time(with_cp, "engine", 10, python_loop=True, cp=True) == pytest.approx(
        compute.framework_time(without, "engine", 10, python_loop=True) + 10 * 7e-5)
    assert compute.framework_time(with_cp, "engine", 10, python_loop=True) == \
        compute.framework_time(without, "engine", 10, python_loop=True)

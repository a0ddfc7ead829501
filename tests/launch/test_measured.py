"""`--partition measured`: with injected node profiles the split is the best one an exhaustive
search finds (each stage timed whole by the planner's stage model) and keeps every stage within
its node's memory; end to end, stages pinned to 2 and 1 threads measure their nodes (real probes,
a cache of their own) and get unequal layer counts in the direction the measurement says."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from stagewise.launch.measured import measured_plan, split_layers
from stagewise.launch.start import start_stages
from stagewise.model.loader import open_checkpoint
from stagewise.parallel.plan import PipelineStageInfo
from stagewise.parallel.runplan import RunPlan
from stagewise.planner.compute import stage_compute, stage_ops, stage_role
from stagewise.planner.estimate import Workload
from stagewise.planner.profiles import profile_from_dict

MODEL = "smollm2-135m"


def _profile(name: str, *, rate: float, bandwidth: float, memory: float, layer_s: float = 2e-5) -> object:
    """A node: its q4_1 / q8_0 linear at ``rate`` seconds per weight, ``bandwidth`` bytes/s."""
    quant = {q: {"s_per_weight": rate, "flops": 5e10} for q in ("q4_1", "q8_0")}
    return profile_from_dict({
        "name": name, "kind": "cpu", "memory_bytes": int(memory), "peak_flops": {"float32": 5e10},
        "memory_bandwidth": bandwidth, "efficiency": {"matmul": 1.0, "attention": 1.0, "memory": 1.0},
        "op_overhead_s": 1e-6, "links": {k: {"latency_s": 2e-5, "bandwidth": 5e9} for k in ("tp", "pp", "ep")},
        "quant": quant, "framework": {"layer_s": layer_s, "engine_s": 2e-4, "head_s": 4e-4, "middle_s": 1e-4,
                                      "last_s": 6e-4, "tokens_s": 1e-4}})


def _exhaustive(config, profiles, prec, layers: int, fits) -> tuple[float, list]:
    """The smallest largest stage time over every split, each stage timed whole by the planner."""
    best = (float("inf"), None)
    n = len(profiles)
    for cuts in itertools.combinations(range(1, layers), n - 1):
        bounds = [0, *cuts, layers]
        ranges = list(zip(bounds, bounds[1:]))
        if not all(fits(s, a, b) for s, (a, b) in enumerate(ranges)):
            continue
        # each stage with its role's fixed step cost; stage 0 of several also takes the tokens back
        infos = [PipelineStageInfo(s, n, a, b, layers) for s, (a, b) in enumerate(ranges)]
        worst = max(stage_compute(stage_ops(config, info, rows=1, new_tokens=1, context=64, prec=prec), profiles[s],
                                  "float32", role=stage_role(info), num_layers=b - a).time_s
                    + (profiles[0].framework["tokens_s"] if s == 0 and n > 1 else 0.0)
                    for s, (info, (a, b)) in enumerate(zip(infos, ranges)))
        best = min(best, (worst, ranges), key=lambda x: x[0])
    return best


@pytest.fixture(scope="module")
def small():
    config = dataclasses.replace(open_checkpoint(MODEL).config, num_layers=7)
    prec = Workload(input_length=1, output_length=1, weight_dtype="float32", kv_dtype="float32",
                    weight_quant="q4_1", embed_quant="q8_0").precision()
    return config, prec


@pytest.mark.parametrize("rates", [(1e-10, 1e-10, 1e-10), (1e-10, 3e-10, 1e-10), (4e-10, 1e-10, 2e-10),
                                   (1e-10, 2e-10)])
def test_the_split_is_the_best_of_every_split(small, rates):
    config, prec = small
    profiles = [_profile(f"n{i}", rate=r, bandwidth=1e10 / (1 + i), memory=64 << 30) for i, r in enumerate(rates)]
    got = split_layers(config, profiles, prec=prec, context=64, kv_tokens=64)
    worst, ranges = _exhaustive(config, profiles, prec, config.num_layers, lambda s, a, b: True)
    assert max(got.stage_s) == pytest.approx(worst, rel=1e-9)
    assert got.ranges == ranges or max(got.stage_s) == pytest.approx(worst, rel=1e-12)
    assert got.tpot_s == pytest.approx(sum(got.stage_s))


def test_every_stage_stays_within_its_nodes_memory(small):
    config, prec = small
    fast_but_small = _profile("small", rate=1e-11, bandwidth=1e11, memory=36 << 20)  # the embedding and a few layers
    slow = _profile("big", rate=1e-9, bandwidth=1e9, memory=64 << 30)
    free = split_layers(config, [_profile("a", rate=1e-11, bandwidth=1e11, memory=64 << 30), slow], prec=prec,
                        context=64, kv_tokens=64)
    got = split_layers(config, [fast_but_small, slow], prec=prec, context=64, kv_tokens=64)
    assert got.ranges[0][1] < free.ranges[0][1]  # fewer layers than its speed alone would give it
    assert all(b <= 0.9 * m for b, m in zip(got.stage_bytes, got.memory))
    with pytest.raises(ValueError, match="no split of the 7 layers fits the nodes' free memory"):
        split_layers(config, [fast_but_small, _profile("tiny", rate=1e-9, bandwidth=1e9, memory=1 << 20)],
                     prec=prec, context=64, kv_tokens=64)


def test_stages_on_1_and_2_threads_get_layers_as_their_measurement_says(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = open_checkpoint(MODEL)
    # The 2-thread stage first: the last stage also runs the LM head, which would blur the direction.
    plan = RunPlan.from_dict({"model": MODEL, "partition": "measured", "stages": [{"threads": 2}, {"threads": 1}]},
                             ckpt.config.num_layers)
    assert plan.partition == "measured"
    placed = measured_plan(plan, ckpt, lambda p, **kw: start_stages(p, "local", **kw))
    (a0, b0), (a1, b1) = [(s.start_layer, s.end_layer) for s in placed.stages]
    assert a0 == 0 and b0 == a1 and b1 == ckpt.config.num_layers and placed.partition == "measured"
    nodes = sorted((tmp_path / "cache" / "stagewise" / "nodes").glob("*.json"))
    assert [p.name.split("-t")[-1].split("-")[0] for p in nodes] == ["1", "2"]  # each node measured, and cached
    import json

    from stagewise.model import shapes
    from stagewise.planner.compute import layer_ops, op_time

    # A decoder layer's decode step on each node, as its measurement says (stage order: 2, then 1 thread).
    prec = Workload(input_length=1, output_length=1, weight_dtype="float32", kv_dtype="float32",
                    weight_quant="q4_1", embed_quant="q8_0").precision()
    per_layer = []
    for path in reversed(nodes):
        prof = profile_from_dict(json.loads(path.read_text()))
        ops = layer_ops(ckpt.config, 0, rows=1, new_tokens=1, context=512, prec=prec, sharding=shapes.Sharding())
        per_layer.append(sum(op_time(op, prof, "float32")[0] for op in ops) + prof.framework["layer_s"])
    faster = 0 if per_layer[0] < per_layer[1] else 1
    layers = [b0 - a0, b1 - a1]
    err = capsys.readouterr().err
    # The split is the one the two measurements give (both nodes on this host: half its memory each) ...
    profiles = [profile_from_dict(json.loads(path.read_text())) for path in reversed(nodes)]
    profiles = [dataclasses.replace(p, memory_bytes=p.memory_bytes // 2) for p in profiles]
    expected = split_layers(ckpt.config, profiles, prec=prec, context=512,
                            kv_tokens=ckpt.config.max_position_embeddings)
    assert [(a0, b0), (a1, b1)] == expected.ranges, (per_layer, err)
    # ... and when the faster node is the one without the LM head, it holds more layers.
    if faster == 0:
        assert layers[0] > layers[1], (per_layer, layers, err)
    assert "stage 1: layers" in err and "predicted TPOT at batch 1" in err

"""Stage plans: the partition policies even and ceil, explicit ranges,
and the cost-balanced policy (checked against brute force)."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from stagewise.model.config import ModelConfig
from stagewise.model.hf_config import parse_hf_config
from stagewise.parallel import PipelineStageInfo, StagePlan, decode_layer_costs, partition_layers

CONFIGS = Path(__file__).resolve().parents[3] / "shared" / "configs"

# Qwen3-VL-235B-A22B (L = 94), even partition: the [start, end) ranges of its planning tables.
QWEN3_VL_EVEN = {
    2: [(0, 47), (47, 94)],
    4: [(0, 24), (24, 48), (48, 71), (71, 94)],
    8: [(0, 12), (12, 24), (24, 36), (36, 48), (48, 60), (60, 72), (72, 83), (83, 94)],
}


@pytest.mark.parametrize("stages", sorted(QWEN3_VL_EVEN))
def test_even_reproduces_the_qwen3_vl_ranges(stages):
    assert partition_layers(94, stages, "even") == QWEN3_VL_EVEN[stages]


def test_even_on_the_real_config():
    path = CONFIGS / "qwen3-vl-235b-a22b.json"
    if not path.exists():
        pytest.skip("shared/configs is not beside the repository")
    config = parse_hf_config(json.loads(path.read_text()))
    assert config.num_layers == 94
    assert StagePlan.for_model(config, 4).ranges == QWEN3_VL_EVEN[4]


def test_ceil_follows_its_formula():
    # layers_per_stage = ceil(L / S); start = min(s * per, L); end = min((s + 1) * per, L)
    assert partition_layers(10, 4, "ceil") == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert partition_layers(94, 8, "ceil")[-1] == (84, 94)
    # S > L: later stages are empty; allowed for the planner, refused otherwise.
    assert partition_layers(3, 5, "ceil", allow_empty=True) == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]
    with pytest.raises(ValueError, match=r"stage\(s\) \[3, 4\] without layers"):
        partition_layers(3, 5, "ceil")
    # ceil can empty a stage even with S < L: 10 layers over 6 stages = 2,2,2,2,2,0
    with pytest.raises(ValueError, match=r"stage\(s\) \[5\]"):
        partition_layers(10, 6, "ceil")


def test_even_and_ceil_cover_every_layer_once():
    for total, stages in itertools.product(range(1, 40), range(1, 12)):
        for policy in ("even", "ceil"):
            ranges = partition_layers(total, stages, policy, allow_empty=True)
            assert len(ranges) == stages
            covered = [layer for a, b in ranges for layer in range(a, b)]
            assert covered == list(range(total)), (total, stages, policy)
        sizes = [b - a for a, b in partition_layers(total, stages, "even", allow_empty=True)]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_explicit_ranges_and_their_errors():
    assert partition_layers(30, 3, "0-10,10-22,22-30") == [(0, 10), (10, 22), (22, 30)]
    assert partition_layers(30, 2, [(0, 5), (5, 30)]) == [(0, 5), (5, 30)]
    cases = {
        "0-10,12-30": "layers 10-12 belong to no stage",
        "0-10,8-30": "overlaps the previous stage",
        "0-10,10-10,10-30": "stage 1 range 10-10 is empty",
        "0-10,10-29": "end at layer 29 but the model has 30 layers",
        "0-10;10-30": "bad part",
        "5-10,10-30": "layers 0-5 belong to no stage",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=message):
            partition_layers(30, spec.count(",") + 1, spec)
    with pytest.raises(ValueError, match="3 explicit ranges given for 2 stages"):
        partition_layers(30, 2, "0-10,10-22,22-30")
    with pytest.raises(ValueError, match="num_stages must be an int >= 1"):
        partition_layers(30, 0)


def _brute_force(costs, first, last, stages):
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        stage_costs = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        stage_costs[0] += first
        stage_costs[-1] += last
        value = max(stage_costs)
        if best is None or value < best:
            best = value
    return best


def test_balanced_is_optimal_against_brute_force():
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        costs = [rng.uniform(0.5, 3.0) for _ in range(n)]
        first, last = rng.uniform(0, 4), rng.uniform(0, 6)
        ranges = partition_layers(n, stages, "balanced", costs=(costs, first, last))
        assert [layer for a, b in ranges for layer in range(a, b)] == list(range(n))
        assert all(b > a for a, b in ranges)
        stage_costs = [sum(costs[a:b]) for a, b in ranges]
        stage_costs[0] += first
        stage_costs[-1] += last
        assert max(stage_costs) == pytest.approx(_brute_force(costs, first, last, stages))


def test_balanced_moves_layers_off_the_lm_head_stage():
    # SmolLM2-135M shape: a 49152 x 576 LM head weighs about 5 decoder layers.
    config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, intermediate_size=1536)
    plan = StagePlan.for_model(config, 3, "balanced")
    sizes = [s.num_layers for s in plan.stages]
    assert sum(sizes) == 30 and sizes[-1] < sizes[0]
    per_layer, first, last = decode_layer_costs(config)
    assert per_layer[0] == 576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536
    assert last == 576 + 49152 * 576
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        partition_layers(2, 3, "balanced", costs=([1.0, 1.0], 0.0, 0.0))


def test_stage_info_semantics():
    plan = StagePlan.build(10, 3, "even")
    assert str(plan) == "0-4,4-7,7-10"
    first, middle, last = plan.stages
    assert first.is_first_stage and first.owns_embedding and not first.owns_lm_head
    assert not middle.is_first_stage and not middle.is_last_stage
    assert last.is_last_stage and last.owns_lm_head
    assert middle.active_layer_indices == range(4, 7) and middle.owns_layer(6) and not middle.owns_layer(7)
    assert all(s.enabled for s in plan.stages)
    assert not StagePlan.build(10, 1).stages[0].enabled
    assert plan.stage_of_layer(7) == 2 and plan.send_recv_edges == [(0, 1), (1, 2)]
    assert plan.get_stage(1) == PipelineStageInfo(1, 3, 4, 7, 10)
    with pytest.raises(ValueError, match=r"stage must be in \[0, 3\)"):
        plan.stage(3)

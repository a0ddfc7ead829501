"""Rank numbering of one stage (StageRanks) and of a whole layout (ParallelConfig): the same
numbers, checked against seed 001's [DP, PP, PCP, TP] order written out by hand."""

import json

import pytest

from stagewise.model.collectives import StageGroups
from stagewise.parallel.groups import join_stage_groups, store_host, world_ranks
from stagewise.parallel.ranks import ParallelConfig, StageRanks, stage_ranks
from stagewise.parallel.runplan import RunPlan


def test_stage_groups_follow_pcp_major_tp_minor_order():
    s = StageRanks(tp=4, pcp=2, dcp=2, first=8)
    assert s.ranks == tuple(range(8, 16))
    assert s.groups("tp") == [(8, 9, 10, 11), (12, 13, 14, 15)]
    assert s.groups("dcp") == [(8, 9), (10, 11), (12, 13), (14, 15)]
    assert s.groups("pcp") == [(8, 12), (9, 13), (10, 14), (11, 15)]
    # stage rank 7 = pcp 1, tp 3, dcp 1 -> 4th of the 4 ranks sharing its head's sequence
    assert s.coordinates(7) == {"pcp": 1, "tp": 3, "dcp": 1}
    assert s.cp_rank(7) == 3 and s.cp_rank(0) == 0 and s.cp_rank(4) == 2


def test_cp_rank_enumerates_pcp_then_dcp():
    s = StageRanks(tp=2, pcp=2, dcp=2)
    assert [s.cp_rank(r) for r in range(4)] == [0, 1, 2, 3]
    s = StageRanks(tp=4, pcp=1, dcp=2)
    assert [s.cp_rank(r) for r in range(4)] == [0, 1, 0, 1]


def test_heterogeneous_stages_follow_each_other():
    a, b, c = stage_ranks([(2, 1, 1), (4, 1, 2), (1, 2, 1)])
    assert (a.ranks, b.ranks, c.ranks) == ((0, 1), (2, 3, 4, 5), (6, 7))
    assert b.groups("dcp") == [(2, 3), (4, 5)]
    assert c.groups("pcp") == [(6, 7)] and c.groups("tp") == [(6,), (7,)]


def test_dense_layout_numbers_stages_like_stage_ranks():
    cfg = ParallelConfig.from_sizes(16, tp=2, pp=2, pcp=2, dcp=2)
    assert cfg.dp == 2
    for rank in range(16):
        stage = cfg.stage(rank)
        assert stage.first == rank - rank % 4
        for kind in ("tp", "dcp", "pcp"):
            assert cfg.group(kind, rank).rank_group == stage.group(kind, rank - stage.first)
    assert cfg.coordinates(13) == {"dp": 1, "pp": 1, "pcp": 0, "tp": 1}
    assert cfg.group("pp", 13).rank_group == (9, 13)


@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 4, "dcp": 3}, "dcp=3 must divide tp=4"),
    ({"tp": 0}, "tp: expected an int >= 1"),
    ({"pcp": True}, "pcp: expected an int >= 1"),
    ({"first": -1}, "first: expected an int >= 0"),
])
def test_bad_sizes_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StageRanks(**kwargs)


def test_bad_stage_rank_and_kind_are_named():
    s = StageRanks(tp=2)
    with pytest.raises(ValueError, match=r"stage rank must be an int in \[0, 2\)"):
        s.coordinates(2)
    with pytest.raises(ValueError, match="kind must be tp, dcp or pcp"):
        s.group("pp", 0)


# ---- a run plan's ranks ----------------------------------------------------------------------------


def _plan(**top):
    stages = top.pop("stages", [{"layers": "0-2", "tp": 2}, {"layers": "2-4"}])
    return RunPlan.from_dict({"model": "m", "stages": stages, **top})


def test_run_plan_numbers_its_ranks_like_stage_ranks():
    plan = _plan(pcp=2)
    assert [s.tp for s in plan.stages] == [2, 1]
    assert plan.world_size == 6
    assert plan.members == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert [r.first for r in plan.stage_ranks()] == [0, 4]
    # the plan survives its JSON form (what a launch passes to every process)
    again = RunPlan.from_dict(json.loads(plan.to_json()))
    assert again == plan and again.fingerprint({}) == plan.fingerprint({})
    # a plan-wide tp is every stage's default
    assert [s.tp for s in _plan(tp=3, stages=[{"layers": "0-2"}, {"layers": "2-4", "tp": 1}]).stages] == [3, 1]


def test_each_stage_of_several_ranks_is_a_world_of_its_own():
    """A stage of several ranks joins a torch.distributed world of just its ranks (its leader hosts
    the store, on its host: nothing of it crosses to another host); a stage of one rank joins none;
    only the torch transport between stages puts every rank of the run in one world."""
    plan = _plan(stages=[{"layers": "0-1", "tp": 2}, {"layers": "1-2"}, {"layers": "2-4", "tp": 3}])
    assert [r.first for r in plan.stage_ranks()] == [0, 2, 3]
    assert [world_ranks(plan, s, ["tcp"] * 3) for s in range(3)] == [[0, 1], [], [3, 4, 5]]
    assert world_ranks(plan, 1, ["shm", "torch", "tcp"]) == list(range(6))
    assert join_stage_groups(plan, 1, 0, None, ["tcp"] * 3) == StageGroups()
    with pytest.raises(ValueError, match="stage 0 rank 1: the stage's torch.distributed world needs its store"):
        join_stage_groups(plan, 0, 1, None, ["tcp"] * 3)
    # a stage's world meets on loopback; the run's (torch transport) where its first rank is reached
    assert store_host(["tcp"] * 3, "10.0.0.1") == "127.0.0.1"
    assert store_host(["shm", "torch", "tcp"], "10.0.0.1") == "10.0.0.1"


def test_rank_addresses_and_devices_follow_the_leader():
    spec = RunPlan.from_dict({"model": "m", "stages": [
        {"layers": "0-4", "tp": 4, "listen": "10.0.0.1:7100", "device": "cuda:2"}]}).stages[0]
    assert [spec.rank_listen(r) for r in (0, 3)] == ["10.0.0.1:7100", "10.0.0.1:7103"]
    assert [spec.rank_device(r) for r in (0, 3)] == ["cuda:2", "cuda:5"]
    loop = _plan().stages[0]
    assert loop.rank_listen(1) == "127.0.0.1:0" and loop.rank_device(1) == "cpu"


@pytest.mark.parametrize("top, message", [
    ({"dcp": 2}, "dcp=2 must divide every stage's tp"),
    ({"interleave_size": 3}, "interleave_size=3 must divide block_size=16"),
    ({"tp": 0}, "tp must be an int >= 1"),
    ({"pcp": 0}, "pcp must be an int >= 1"),
    ({"tpot_target_ms": 0}, r"tpot_target_ms must be a finite number of milliseconds > 0 \(or none\), got 0"),
    ({"tpot_target_ms": "20"}, r"tpot_target_ms must be a finite number of milliseconds > 0 \(or none\), got '20'"),
    ({"tpot_target_ms": float("inf")}, r"tpot_target_ms must be a finite number of milliseconds > 0 \(or none\), got inf"),
    ({"stages": [{"layers": "0-4", "tp": "two"}]}, r"stages\[0\].tp must be an int >= 1"),
])
def test_bad_rank_options_are_named(top, message):
    with pytest.raises(ValueError, match=message):
        _plan(**top)


def test_the_tpot_target_travels_with_the_plan():
    plan = _plan(tpot_target_ms=17.5)
    assert plan.tpot_target_ms == 17.5
    assert RunPlan.from_dict(json.loads(plan.to_json())).tpot_target_ms == 17.5
    assert _plan().tpot_target_ms is None

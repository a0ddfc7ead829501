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


def _profile_dict(name: str, *, rate: float, bandwidth: float, memory: float, layer_s: float = 2e-5) -> dict:
    """A node: its q4_1 / q8_0 linear at ``rate`` seconds per weight, ``bandwidth`` bytes/s."""
    quant = {q: {"s_per_weight": rate, "flops": 5e10} for q in ("q4_1", "q8_0")}
    return {"name": name, "kind": "cpu", "memory_bytes": int(memory), "peak_flops": {"float32": 5e10},
            "memory_bandwidth": bandwidth, "efficiency": {"matmul": 1.0, "attention": 1.0, "memory": 1.0},
            "op_overhead_s": 1e-6, "links": {k: {"latency_s": 2e-5, "bandwidth": 5e9} for k in ("tp", "pp", "ep")},
            "quant": quant, "framework": {"layer_s": layer_s, "engine_s": 2e-4, "head_s": 4e-4, "middle_s": 1e-4,
                                         "last_s": 6e-4, "tokens_s": 1e-4}}


def _profile(name: str, **kwargs) -> object:
    return profile_from_dict(_profile_dict(name, **kwargs))


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
    assert err.count("measured now in") == 2  # two nodes (threads) of their own, neither cached before


# ---- where a node's profile comes from -----------------------------------------------------------


def _fake_measure(calls: list):
    """node_profile's measurement, instant: a fixed profile, dated now."""
    import socket
    import time

    from stagewise.measure import node

    def measure(device, types, threads, key, log):
        calls.append((device, tuple(types), threads))
        out = _profile_dict(f"node-{key}", rate=1e-10, bandwidth=1e10, memory=8 << 30)
        out["measured"] = {"cache_version": node.CACHE_VERSION, "seconds": 8.5, "threads": threads,
                           "host": socket.gethostname(), "device": device, "types": sorted(types), "at": time.time()}
        return out

    return measure


def test_a_nodes_profile_says_whether_it_was_measured_now_or_read_from_the_cache(tmp_path, monkeypatch):
    import json
    import os

    import torch

    from stagewise.measure import node

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list = []
    monkeypatch.setattr(node, "_measure", _fake_measure(calls))
    first = node.node_profile("cpu", ("q8_0",))
    path = node.cache_path("cpu", torch.get_num_threads(), ("q8_0",))
    assert first["measured"]["from_cache"] is False and first["measured"]["cache"] == str(path) and path.is_file()
    again = node.node_profile("cpu", ("q8_0",))
    assert len(calls) == 1 and again["measured"]["from_cache"] is True
    assert again["measured"]["at"] == first["measured"]["at"] and again["measured"]["cache"] == str(path)
    fresh = node.node_profile("cpu", ("q8_0",), reuse=False)
    assert len(calls) == 2 and fresh["measured"]["from_cache"] is False
    # A profile cached before dates were kept is dated by its file.
    data = json.loads(path.read_text())
    del data["measured"]["at"]
    path.write_text(json.dumps(data))
    os.utime(path, (1.7e9, 1.7e9))
    assert node.node_profile("cpu", ("q8_0",))["measured"]["at"] == 1.7e9


def test_a_profiles_origin_is_said_with_its_file_and_date():
    import calendar

    from stagewise.launch.measured import profile_origin

    assert profile_origin({"from_cache": False, "seconds": 8.46, "cache": "/c/n.json"}) == \
        "measured now in 8.5 s, cached in /c/n.json"
    assert profile_origin({"from_cache": False, "seconds": 8.46, "cache": None}) == "measured now in 8.5 s"
    at = calendar.timegm((2026, 11, 28, 7, 0, 0))
    assert profile_origin({"from_cache": True, "cache": "/c/n.json", "at": at}, now=at + 5 * 3600) == \
        "cached profile /c/n.json, measured 2026-11-28 07:00 UTC, 5.0 h ago (--remeasure measures it again)"
    assert "3 days ago" in profile_origin({"from_cache": True, "cache": "/c", "at": at}, now=at + 3 * 86400)


def test_the_split_says_where_each_nodes_profile_came_from_and_measures_again_when_asked(tmp_path, monkeypatch):
    """Real probes (threads of this process) asked for their nodes' profiles: the first stage's
    node is measured and cached, the second's (the same node) then read from that cache; a second
    split reads both; with ``remeasure`` the node is measured again, once, and stages on nodes of
    their own (other threads) each measure theirs."""
    import threading

    from stagewise.measure import node
    from stagewise.launch.probe import serve_probe

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list = []
    monkeypatch.setattr(node, "_measure", _fake_measure(calls))
    ckpt = open_checkpoint(MODEL)
    plan = RunPlan.from_dict({"model": MODEL, "partition": "measured", "stages": [{}, {}]}, ckpt.config.num_layers)

    def start(p, extra):
        assert extra == ["--probe"]
        threads, addresses = [], []
        for index, rank in p.members:
            up = threading.Event()

            def announce(host, port, up=up):
                addresses.append((host, port))
                up.set()

            threads.append(threading.Thread(target=serve_probe, args=(p, index, rank, "127.0.0.1:0"),
                                            kwargs={"announce": announce}, daemon=True))
            threads[-1].start()
            assert up.wait(60)

        class Probes:
            def stop(self, grace_s):
                for t in threads:
                    t.join(grace_s + 5)
                assert not any(t.is_alive() for t in threads)

        return Probes(), p, addresses

    def origins(plan=plan, **kw) -> list[str]:
        lines: list[str] = []
        measured_plan(plan, ckpt, start, log=lines.append, **kw)
        return [line for line in lines if "'s node (" in line]

    first = origins()
    assert len(calls) == 1 and first[0].startswith("stage 0's node (")
    assert "measured now in 8.5 s, cached in" in first[0]
    assert first[1].startswith("stage 1's node (") and "cached profile" in first[1] and " s ago" in first[1]
    assert all("cached profile" in line and "--remeasure" in line for line in origins()) and len(calls) == 1
    again = origins(remeasure=True)
    assert "measured now" in again[0] and "cached profile" in again[1] and "--remeasure" not in again[1]
    assert len(calls) == 2
    two = RunPlan.from_dict({"model": MODEL, "partition": "measured", "stages": [{"threads": 1}, {"threads": 2}]},
                            ckpt.config.num_layers)
    assert all("measured now" in line for line in origins(two, remeasure=True)) and len(calls) == 4


def test_remeasure_applies_to_a_measured_partition(tmp_path, capsys):
    import json

    from stagewise.cli import main
    from stagewise.launch.start import process_options

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"model": MODEL, "stages": [{"listen": "127.0.0.1:0"}] * 2}))
    assert main(["launch", str(path), "--remeasure", "--prompt", "hi"]) == 2
    assert "--remeasure applies to a plan with partition: measured" in capsys.readouterr().err
    with pytest.raises(ValueError, match="remeasure applies to partition='measured'"):
        process_options({"remeasure": True, "partition": "even"}, True, 0)
    assert process_options({"remeasure": True, "partition": "measured"}, True, 0)[0]["remeasure"] is True


def test_launch_splits_a_plan_of_this_machine_by_its_cached_profiles(tmp_path, monkeypatch):
    """`stagewise launch` on a measured plan whose stages are all here: the local launcher's
    probes read the nodes' cached profiles, the launch says which files and when they were
    measured, then answers."""
    import json
    import os
    import subprocess
    import sys

    from stagewise.measure import node

    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                   max_position_embeddings=128, bos_token_id=1, eos_token_id=None)
    model = tmp_path / "tiny"
    transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(model)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("STAGEWISE_AUTH_TOKEN", raising=False)
    path = node.cache_path("cpu", 1, ())  # what the probe of a stage of 1 thread looks up for a dense model
    path.parent.mkdir(parents=True)
    cached = _fake_measure([])("cpu", (), 1, path.stem, None)
    cached["measured"]["at"] = 1.7e9
    path.write_text(json.dumps(cached))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": str(model), "partition": "measured",
                                "stages": [{"host": "127.0.0.1", "threads": 1}, {"host": "127.0.0.1", "threads": 1}]}))
    done = subprocess.run([sys.executable, "-m", "stagewise.cli", "launch", str(plan), "--prompt-ids", "5,6,7",
                           "--max-new-tokens", "4", "--json"], capture_output=True, text=True, env=dict(os.environ),
                          timeout=240)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["completions"][0]["token_ids"]) == 4
    origin = f"cached profile {path}, measured 2023-11-14 22:13 UTC"
    assert done.stderr.count(origin) == 2, done.stderr

"""`stagewise plan validate --tp --dcp`: cells of stages split over ranks, the skip line for a
(tp, dcp) the model does not allow, the profile's TP link (a real 2-process gloo run), ranks
counted as busy processes, and `--heads` (a GGUF model regrouped for TP/DCP sizes its heads do
not allow)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stagewise.bench import plan_validate, regroup
from stagewise.bench.plan_validate.compare import _oversubscribed
from stagewise.bench.profile.tp import fit_tp_link, measure_tp_link
from stagewise.model.loader import open_checkpoint
from stagewise.planner import validate
from stagewise.planner.estimate import Workload, estimate_layout, slowdown
from stagewise.planner.profiles import load_profile, process_slowdown
from stagewise.parallel.ranks import ParallelConfig

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mqa_llama(tmp_path_factory):
    """A tiny random Llama with one KV head: tp 2 and dcp 2 are valid, dcp 2 without tp is not."""
    import torch

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mqa") / "m"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=96, max_position_embeddings=128)).save_pretrained(path)
    return path


def test_tp_and_dcp_cells_run_for_real_with_tiny_and_a_disallowed_pair_is_skipped(tmp_path, monkeypatch, capsys,
                                                                                   mqa_llama):
    store = tmp_path / "validation.json"
    monkeypatch.setattr(validate, "STORE", store)
    out = tmp_path / "out"
    argv = [str(mqa_llama), "--tiny", "--stages", "1", "--tp", "1", "2", "--dcp", "1", "2",
            "--input-length", "8", "--device-profile", "cpu-generic", "--out", str(out)]
    assert plan_validate.main(argv) == 0
    err = capsys.readouterr().err
    assert ("skipping tp=1 dcp=2: dcp=2 at tp=1: each of the 1 KV heads is held by 1 rank(s), which dcp must "
            "divide; valid dcp sizes at tp=1: 1") in err
    (path,) = out.glob("*-plan-validate.json")
    data = json.loads(path.read_text())
    tpot = {(r["tp"], r["dcp"]): r for r in data["rows"] if r["metric"] == "tpot"}
    assert set(tpot) == {(1, 1), (2, 1), (2, 2)}
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in tpot.values())
    assert data["range"]["tp"] == [1, 2] and data["range"]["dcp"] == [1, 2]
    collectives = {(r["tp"], r["dcp"]): r for r in data["rows"] if r["metric"] == "collectives"}
    assert set(collectives) == {(2, 1), (2, 2)}  # the ranks' collectives, measured and predicted
    # measured: the whole run's minus a prompt-only run's, a difference of noisy figures at toy sizes
    assert all(isinstance(r["measured_s"], float) and r["predicted_s"] > 0 for r in collectives.values())
    assert "collectives" not in data["expected_error_pct"]
    assert data["skipped"] == [{"tp": 1, "dcp": 2, "why": data["skipped"][0]["why"]}]
    assert data["model_shapes"]["num_kv_heads"] == 1
    md = path.with_suffix(".md").read_text()
    assert "| batch | S | TP | DCP |" in md and "layouts (TP, DCP): (1, 1), (2, 1), (2, 2)" in md
    assert not store.exists()  # toy sizes never become the record


def test_a_validation_with_tp_cells_states_their_errors_for_tp_layouts_only():
    rows = [{"stages": 1, "tp": tp, "dcp": 1, "batch": 1, "metric": "tpot", "error_pct": err,
             "predicted_s": 0.01, "measured_s": 0.01} for tp, err in ((1, 5.0), (2, 12.0))]
    data = validate.summary(rows, model="m", architecture="llama", profile={"name": "p", "kind": "cpu"},
                            workload={"batch": [1], "input_length": 16, "output_length": 4}, machine={})
    v = validate.Validation(data)
    common = dict(pp=1, batch=1, input_length=16, output_length=4, architecture="llama", profile_name="p",
                  profile_kind="cpu")
    assert v.confidence(tp=2, **common).error_pct == {"tpot": 12.0}
    assert v.confidence(tp=1, **common).error_pct == {"tpot": 5.0}
    assert "TP=3 outside validated 1..2" in v.confidence(tp=3, **common).not_validated_because


def test_the_tp_link_is_measured_between_two_gloo_processes():
    link = measure_tp_link(sizes=(2304, 65536), calls=5, log=lambda line: None)
    assert link["latency_s"] >= 0 and link["bandwidth"] > 0
    assert set(link["all_reduce_s"]) == set(link["all_gather_s"]) == {"2304", "65536"}
    assert all(0 < t < 1 for t in [*link["all_reduce_s"].values(), *link["all_gather_s"].values()])


def test_the_fit_gives_back_the_link_of_the_planners_ring_formulas():
    lat, bw = 150e-6, 3e9
    sizes = (2304, 8192, 65536, 1 << 20)
    ar = {b: 2 * lat + b / bw for b in sizes}  # 2 ranks: 2 (n-1)/n B/bw + 2 (n-1) lat
    ag = {b: lat + 2 * b / 2 / bw for b in sizes}  # gathered 2b: (n-1)/n 2b/bw + (n-1) lat
    got = fit_tp_link(ar, ag)
    assert got == pytest.approx((lat, bw), rel=1e-6)


def test_ranks_of_a_stage_count_as_busy_processes_on_the_cores():
    base = load_profile("cpu-generic")
    import dataclasses

    prof = dataclasses.replace(base, concurrency={"1": 1.0, "2": 1.1, "3": 1.6, "4": 2.2})
    two = prof.for_ranks(2)
    assert slowdown(two, 1.0) == pytest.approx(slowdown(prof, 2.0))
    assert slowdown(two, 2.0) == pytest.approx(slowdown(prof, 4.0))
    assert slowdown(two, 3.0) == pytest.approx(slowdown(prof, 6.0))
    assert prof.for_ranks(1) is prof
    # the paces read by hand: linear between the measured counts, proportional beyond, relative to ref
    assert [process_slowdown(prof, b) for b in (1.0, 2.5, 8.0)] == pytest.approx([1.0, 1.35, 4.4])
    ref = dataclasses.replace(base, concurrency={"ref": 0.8, "1": 1.0, "3": 2.0})
    assert [process_slowdown(ref, b) for b in (1.0, 2.0, 6.0)] == pytest.approx([1.25, 1.875, 5.0])
    assert two.for_ranks(2) is two  # applied twice, counted once
    with pytest.raises(ValueError, match="already counts 2 processes a stage"):
        two.for_ranks(3)
    cores = dataclasses.replace(base, cores=2)  # no measured paces: take turns on the cores
    assert slowdown(cores.for_ranks(2), 2.0) == pytest.approx(2.0)
    assert slowdown(cores.for_ranks(2), 1.0) == pytest.approx(1.0)


def test_the_tp_link_prices_a_tp_layouts_collectives(mqa_llama):
    config = open_checkpoint(str(mqa_llama)).config
    prof = load_profile("cpu-generic")
    slow_link = dataclasses_replace_link(prof, latency_s=1e-3)
    work = Workload(input_length=16, output_length=4, weight_dtype="float32", kv_dtype="float32")
    layout = ParallelConfig(world_size=2, tp=2, dcp=2)
    fast = estimate_layout(config, layout, work, prof).tpot_s
    slow = estimate_layout(config, layout, work, slow_link).tpot_s
    # per layer: 2 all-reduces (2 latencies each), the all-gathers of q and of the partial results
    # (1 each); the embedding's all-reduce (2) and the logits' gather to the leader (1)
    extra = config.num_layers * (2 * 2 + 1 + 1) + 2 + 1
    assert slow - fast == pytest.approx(extra * (1e-3 - prof.links["tp"].latency_s), rel=1e-6)


def dataclasses_replace_link(prof, *, latency_s: float):
    import dataclasses

    from stagewise.planner.profiles import Link

    return dataclasses.replace(prof, links={**prof.links, "tp": Link(latency_s, prof.links["tp"].bandwidth)})


def test_rank_processes_beyond_the_cores_are_named_in_the_estimate_and_the_results(mqa_llama):
    """More rank processes than cores: a stage's ranks wait in collectives for descheduled partners,
    which the estimate does not price; it says so, and plan validate names those cells."""
    import dataclasses

    cfg = open_checkpoint(str(mqa_llama)).config
    prof = dataclasses.replace(load_profile("cpu-generic"), cores=2)
    work = Workload(batch=1, input_length=8, output_length=4)
    note = "4 rank processes on 2 cores"
    two = estimate_layout(cfg, ParallelConfig(world_size=4, pp=2, tp=2), work, prof).notes
    assert any(note in n and "not price" in n for n in two)
    one_core = dataclasses.replace(prof, cores=1)
    for layout, p in ((ParallelConfig(world_size=2, tp=2), prof), (ParallelConfig(world_size=2, pp=2), one_core)):
        # the ranks fit the cores; stages of one rank each, which meet in no collective
        assert not any("rank processes on" in n for n in estimate_layout(cfg, layout, work, p).notes)
    rows = [{"batch": 4, "stages": 2, "tp": 2, "dcp": 1, "oversubscribed": True},
            {"batch": 1, "stages": 1, "tp": 2, "dcp": 1, "oversubscribed": False}]
    [text, _] = _oversubscribed(rows, 2)
    assert "than the 2 cores (batch, S, TP, DCP): (4, 2, 2, 1)." in text and "(1, 1, 2, 1)" not in text
    assert _oversubscribed(rows[1:], 2) == []


def test_heads_regroups_a_gguf_and_keeps_every_other_tensor(tmp_path):
    import gguf
    from helpers.gguf_files import write_gguf

    src = tmp_path / "tiny.gguf"
    write_gguf(src)  # 4 query / 2 KV heads, hidden 64
    path, note = regroup.regrouped_model(str(src), "4/1", cache_dir=tmp_path / "cache", log=lambda line: None)
    assert "regrouped from 4 query / 2 KV heads into 4 / 1 of 16 dims" in note
    config = open_checkpoint(path).config
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 1, 16)
    before = {t.name: t for t in gguf.GGUFReader(src).tensors}
    after = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert before.keys() == after.keys()
    for name, t in after.items():
        old = before[name]
        assert t.tensor_type == old.tensor_type
        if name.split(".")[-2] in ("attn_k", "attn_v"):
            assert np.array_equal(t.data, old.data[:16])
        else:
            assert np.array_equal(t.data, old.data)
    with pytest.raises(ValueError, match="KV must divide Q"):
        regroup.regrouped_model(str(src), "4/3", cache_dir=tmp_path / "cache")


def test_no_allowed_layout_is_an_error_before_anything_is_measured(tmp_path, capsys, mqa_llama):
    argv = [str(mqa_llama), "--tiny", "--tp", "3", "--dcp", "1", "--out", str(tmp_path / "out")]
    assert plan_validate.main(argv) == 2
    err = capsys.readouterr().err
    assert "skipping tp=3 dcp=1: tp=3 does not split num_attention_heads=4" in err
    assert "no (tp, dcp) of --tp and --dcp that the model allows" in err
    assert "measuring this machine's profile" not in err and not (tmp_path / "out").exists()

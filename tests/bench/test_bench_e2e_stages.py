"""`stagewise bench e2e --stages` (and `--launcher ray`, `--recovery`) on a tiny random model: it runs, compares
tokens with S = 1 (with local spawn) and writes its table (the SmolLM2 figures are committed under
bench/results/)."""

from __future__ import annotations

import json

import pytest
import torch

from stagewise.cli import main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama saved by transformers."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64))
    path = tmp_path_factory.mktemp("tiny") / "m"
    hf.save_pretrained(path)
    return str(path)


def test_bench_e2e_stages_writes_results(tiny, tmp_path, capsys):
    code = main(["bench", "e2e", "--model", tiny, "--stages", "2", "--prompt-len", "4",
                 "--new-tokens", "3", "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads(next(tmp_path.glob("*-e2e-stages.json")).read_text())
    rows = {(r["stages"], r["requests"]): r for r in data["rows"]}
    assert set(rows) == {(1, 1), (1, 4), (2, 1), (2, 8)}
    assert rows[(2, 1)]["tokens_equal_s1"] is True
    assert len(rows[(2, 8)]["busy_pct"]) == 2 and all(0 < b <= 100 for b in rows[(2, 8)]["busy_pct"])
    timeline = rows[(2, 1)]["timeline_us"]
    assert list(timeline)[:3] == ["stage 0 compute", "stage 0 compute -> send", "stage 0 send"]
    # A hop may be negative (the receiver had the frame before the sender's call returned).
    assert timeline["stage 1 compute"] > 0 and {"hop 0 -> 1", "hop 1 -> 0"} <= set(timeline)
    assert rows[(2, 1)]["timeline_cycle_us"] > timeline["stage 0 compute"] + timeline["stage 1 compute"]
    # The floor: the same layers in bare processes generate the same tokens, in one and in two.
    assert rows[(2, 1)]["bare_tokens_equal"] is True
    assert all(rows[(2, 1)][f"bare_{m}_ms"] > 0 for m in ("one", "sleep", "spin"))
    out = capsys.readouterr().out
    assert "overhead %" in out and "| hop 0 -> 1 |" in out and "floor % (the better)" in out


@pytest.mark.parametrize("parts", [[(0, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)]])
def test_bare_handoff_generates_the_pipelines_tokens_in_every_mode_and_leaves_no_process(tiny, parts):
    from stagewise.api import Pipeline
    from stagewise.bench.e2e.handoff import Handoff

    prompt = [5, 17, 3, 60, 2]
    with Pipeline(tiny, dtype="float32") as pipe:
        want = pipe.generate(prompt_token_ids=[prompt], max_new_tokens=6, ignore_eos=True)[0].token_ids
    bare = Handoff(tiny, parts, dtype="float32", quantized=None, precision="exact", max_len=32)
    try:
        for _ in range(2):  # a second run starts a new request in every part
            for processes, spin in ((False, False), (True, False), (True, True)):
                got = bare.run(prompt, 6, processes=processes, spin=spin)
                assert got["tokens"] == want, (processes, spin)
                assert 0 < got["median_s"] and 0 < got["mean_s"]
    finally:
        bare.close()
    assert len(bare.procs) == len(parts) - 1 and all(p.poll() is not None for p in bare.procs)


def test_bare_handoff_refuses_a_split_of_one_part(tiny):
    from stagewise.bench.e2e.handoff import Handoff

    with pytest.raises(ValueError, match="at least two parts"):
        Handoff(tiny, [(0, 3)], dtype="float32", quantized=None, precision="exact", max_len=32)


def test_bench_e2e_launcher_ray_writes_results_beside_local(tiny, tmp_path, capsys):
    pytest.importorskip("ray")
    code = main(["bench", "e2e", "--model", tiny, "--launcher", "ray", "--stages", "2",
                 "--prompt-len", "4", "--new-tokens", "3", "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads(next(tmp_path.glob("*-e2e-launchers.json")).read_text())
    local, ray = data["rows"]
    assert (local["launcher"], ray["launcher"]) == ("local", "ray")
    assert local["tpot_vs_local_b1"] == 1.0 and ray["tpot_vs_local_b1"] > 0
    assert ray["tokens_equal_b1"] is True and ray["tokens_equal_b8"] is True
    assert data["machine"]["stages"] == 2 and "TPOT ratio" in capsys.readouterr().out


def test_bench_e2e_recovery_writes_the_delays_beside_a_whole_restart(tiny, tmp_path, capsys):
    code = main(["bench", "e2e", "--model", tiny, "--recovery", "--stages", "2", "--prompt-len", "4",
                 "--new-tokens", "48", "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads(next(tmp_path.glob("*-e2e-recovery.json")).read_text())
    rows = {r["case"]: r for r in data["rows"]}
    assert list(rows) == ["undisturbed", "killed, stage rejoins", "killed, every stage anew", "hung, stage rejoins"]
    assert all(r["tokens_equal"] for r in rows.values()), rows
    assert rows["undisturbed"]["delay_s"] == 0 and rows["hung, stage rejoins"]["delay_s"] > 2.0  # the heartbeat
    assert "delay s" in capsys.readouterr().out


def test_bench_e2e_speculative_writes_results(tiny, tmp_path, capsys):
    code = main(["bench", "e2e", "--model", tiny, "--speculative", "ngram,draft", "--num-speculative-tokens", "2",
                 "--stages", "1,2", "--new-tokens", "12", "--repeats", "1", "--tiny", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads(next(tmp_path.glob("*-e2e-speculative.json")).read_text())
    rows = {(r["task"], r["stages"], r["method"], r["k"]): r for r in data["rows"]}
    assert set(rows) == {(t, s, m, k) for t in ("rewrite", "chat") for s in (1, 2)
                         for m, k in ((None, None), ("ngram", 2), ("draft", 2))}
    assert all(r["tokens_equal_no_drafts"] for r in rows.values())
    # The model drafting for itself: most drafts accepted (its int8 linears round a little differently).
    assert rows[("rewrite", 2, "draft", 2)]["acceptance"] > 0.5 and "speed-up" in capsys.readouterr().out
    assert main(["bench", "e2e", "--model", tiny, "--speculative", "eagle"]) == 2

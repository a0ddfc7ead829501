"""`stagewise bench e2e` on a tiny random Llama saved with save_pretrained: the JSON and Markdown
it writes, the transformers baseline in every row, and the byte count of the memory floor."""

from __future__ import annotations

import json

import pytest
import torch

from stagewise.bench.cli import main
from stagewise.bench.e2e import compare
from stagewise.bench.e2e.prompts import make_prompts
from stagewise.model.loader import load_stage_weights, open_checkpoint
from stagewise.model.stage import StageModel

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, SMALL["vocab_size"])}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def test_e2e_writes_rows_with_the_transformers_baseline(folder, tmp_path):
    out = tmp_path / "results"
    argv = ["e2e", "--model", str(folder), "--batch-sizes", "1,3", "--prompt-len", "6", "--new-tokens", "5",
            "--repeats", "2", "--threads", "1", "--tiny", "--out", str(out)]
    assert main(argv) == 0
    [js] = list(out.glob("*-e2e-t1.json"))
    md = js.with_suffix(".md")
    data = json.loads(js.read_text())
    assert data["machine"]["torch_threads"] == 1 and data["copy_bandwidth"]["gbps"] > 0
    assert [(r["batch"], r["linear_precision"]) for r in data["rows"]] == [
        (1, "exact"), (1, "int8"), (3, "exact"), (3, "int8")]
    for row in data["rows"]:
        assert (row["prompt_len"], row["new_tokens"]) == (6, 5)
        o, t = row["ours"], row["baselines"]["transformers"]
        for s in (o, t):
            assert s["runs"] == 2 and s["ttft_ms"] > 0 and s["decode_tokens_per_s"] > 0 and s["decode_step_ms"] > 0
        assert t["decode_speedup"] == pytest.approx(o["decode_tokens_per_s"] / t["decode_tokens_per_s"])
        assert t["ttft_speedup"] == pytest.approx(t["ttft_ms"] / o["ttft_ms"])
        assert row["ours_pct_floor"] > 0 and t["pct_floor"] > 0
        # Same weights, prompts and greedy decoding in float32: the same tokens, row by row (the
        # int8 mode is approximate: its agreement is a figure of the results, not asserted).
        if row["linear_precision"] == "exact":
            assert t["rows_matching"] == row["batch"]
    text = md.read_text()
    assert "| batch |" in text and "transformers tok/s" in text and "decode x transformers" in text
    # A float32 safetensors model runs both: exact, and int8 over Q8_0 blocks quantised at load.
    for mode in ("exact", "int8"):
        assert text.count(f"\n| 1 | 6 | 5 | {mode} |") == 1 and text.count(f"\n| 3 | 6 | 5 | {mode} |") == 1
    assert data["machine"]["linear_precisions"] == ["exact", "int8"] and data["machine"]["skipped_precisions"] == []
    # The ISA the kernels ran at names the device and heads the results.
    isa = data["machine"]["cpu_isa"]
    assert js.name.endswith(f"-{isa}-e2e-t1.json") and f"ISA: stagewise kernels at {isa}" in text


def test_default_out_is_a_dated_folder_of_its_own(folder, tmp_path, monkeypatch):
    """Without --out nothing lands in bench/results itself: a folder named by device and day."""
    monkeypatch.chdir(tmp_path)
    argv = ["e2e", "--model", str(folder), "--batch-sizes", "1", "--prompt-len", "4", "--new-tokens", "2",
            "--repeats", "1", "--threads", "1", "--tiny"]
    assert main(argv) == 0
    [folder_made] = list((tmp_path / "bench" / "results").iterdir())
    assert folder_made.is_dir() and folder_made.name.startswith("cpu-") and len(list(folder_made.glob("*-e2e-t1.*"))) == 2


def test_llama_cpp_baseline_needs_a_gguf(folder, tmp_path, capsys):
    argv = ["e2e", "--model", str(folder), "--batch-sizes", "1", "--prompt-len", "4", "--new-tokens", "2",
            "--repeats", "1", "--threads", "1", "--tiny", "--baseline", "llama.cpp", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "the llama.cpp baseline needs a GGUF model" in capsys.readouterr().err


def test_prompts_have_the_asked_length_and_differ(folder):
    ckpt = open_checkpoint(str(folder))
    prompts = make_prompts(ckpt, 4, 10)
    assert [len(p) for p in prompts] == [10] * 4
    assert len({tuple(p) for p in prompts}) == 4
    assert all(0 <= t < SMALL["vocab_size"] for p in prompts for t in p)


def test_floor_bytes_match_the_model_tensors(folder):
    ckpt = open_checkpoint(str(folder))
    cfg = ckpt.config
    stage = StageModel.from_weights(cfg, 0, cfg.num_layers, load_stage_weights(ckpt, 0, cfg.num_layers))
    # Every parameter is read once per decode step, except the embedding: only the batch's rows
    # (its untied copy is the LM head, read whole, and counted among the parameters).
    params = sum(p.numel() * p.element_size() for name, p in stage.named_parameters()
                 if not name.startswith("embedding."))
    for batch in (1, 5):
        assert compare.weight_bytes_per_step(cfg, batch, 4) == params + batch * cfg.hidden_size * 4
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert compare.kv_bytes_per_token(cfg, 4) == kv
    floor = compare.memory_floor(cfg, 2, 10, 3, 4, gbps=1.0)
    # Two steps at contexts 10 and 11, each reading those tokens and writing one more, for 2 rows.
    total = 2 * (params + 2 * cfg.hidden_size * 4) + 2 * (11 + 12) * kv
    assert floor["bytes_per_step_mean"] == pytest.approx(total / 2)
    assert floor["floor_tokens_per_s"] == pytest.approx(2 * 2 / (total / 1e9))


def test_e2e_tp_runs_ranks_beside_the_single_process(folder, tmp_path, capsys):
    """4 query / 2 KV heads: tp 2 runs (2 rank processes), dcp 2 at tp 2 is skipped, saying why."""
    out = tmp_path / "results"
    assert main(["e2e", "--model", str(folder), "--tp", "1,2", "--dcp", "1,2", "--tiny", "--out", str(out)]) == 0
    assert "skipping tp=2 dcp=2: dcp=2 at tp=2" in capsys.readouterr().err
    [path] = out.glob("*-e2e-parallel-tp1-2.json")  # named by the layouts that ran
    rows = json.loads(path.read_text())["rows"]
    assert [(r["tp"], r["dcp"]) for r in rows] == [(1, 1), (2, 1)]
    two = rows[1]
    # the decode's collectives: their bytes exactly (the time is a difference of two runs' counters,
    # which the noise of a few toy steps may take below zero)
    assert two["tokens_equal_tp1"] and two["collective_kb"] > 0 and two["kv_mb_per_rank"] > 0
    assert isinstance(two["collective_ms"], float)
    assert path.with_suffix(".md").read_text().count("| 2 | 1 | 1 |") == 1


def test_e2e_with_an_image_on_a_vision_model(tmp_path):
    """`--image WxH` on a tiny Qwen3-VL: every row starts with the image, both sides take the same
    pixel values, and the greedy tokens agree row by row."""
    from helpers.vl_models import build, save

    folder = save(build("dense"), tmp_path / "vl")
    out = tmp_path / "results"
    argv = ["e2e", "--model", str(folder), "--image", "40x24", "--batch-sizes", "2", "--prompt-len", "5",
            "--new-tokens", "4", "--repeats", "1", "--threads", "1", "--tiny", "--linear-precision", "exact",
            "--out", str(out)]
    assert main(argv) == 0
    [js] = list(out.glob("*-e2e-t1.json"))
    [row] = json.loads(js.read_text())["rows"]
    assert (row["image"], row["image_tokens"], row["prompt_len"]) == ("40x24", 15, 5 + 15 + 2)  # 6 x 10 patches
    assert row["baselines"]["transformers"]["rows_matching"] == 2
    assert main(["e2e", "--model", str(folder), "--image", "big", "--tiny", "--out", str(out)]) == 2


@pytest.mark.parametrize("flags, on, off", [
    ("fpu avx avx2 fma f16c bmi2 avx512f avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16",
     ["AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16"], ["AVX512_VBMI", "AVX_VNNI"]),
    ("fpu avx avx2 fma f16c bmi2", ["AVX", "AVX2", "FMA"], ["AVX512", "AVX512_VNNI"]),
])
def test_llama_cpp_build_takes_the_cpus_isa_and_never_amx(flags, on, off):
    from stagewise.bench.llama_cpp import build_args

    args = build_args(f"processor\t: 0\nflags\t\t: {flags}\n").split()
    assert "-DGGML_NATIVE=OFF" in args and "-DLLAMA_CURL=OFF" in args
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    assert all(f"-DGGML_{n}=ON" in args for n in on) and all(f"-DGGML_{n}=OFF" in args for n in off)
    # A CPU whose flags name none of them (not x86, or no /proc/cpuinfo): a native build.
    assert build_args("processor\t: 0\nFeatures\t: fp asimd\n") == "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF"

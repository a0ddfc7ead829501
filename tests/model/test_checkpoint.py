"""HF safetensors checkpoints: a stage's tensors equal the model's own, and only they are read."""

import json
import os
import re
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from stagewise.model.loader import load_stage_weights, open_checkpoint  # noqa: E402
from stagewise.model.loader.hf_folder import HFCheckpoint  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    "llama_tied": (transformers.LlamaConfig, dict(SMALL, num_hidden_layers=6, tie_word_embeddings=True)),
    "llama_untied": (transformers.LlamaConfig, dict(SMALL, num_hidden_layers=6, tie_word_embeddings=False,
                                                    attention_bias=True, mlp_bias=True)),
    "qwen3": (transformers.Qwen3Config, dict(SMALL, num_hidden_layers=4, head_dim=16, tie_word_embeddings=False)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(SMALL, num_hidden_layers=4, head_dim=8, num_experts=4,
                                                    num_experts_per_tok=2, moe_intermediate_size=16,
                                                    mlp_only_layers=[1])),
    "falcon_new": (transformers.FalconConfig, dict(vocab_size=64, hidden_size=32, num_hidden_layers=4,
                                                   num_attention_heads=4, new_decoder_architecture=True,
                                                   num_kv_heads=2)),
    "falcon_7b": (transformers.FalconConfig, dict(vocab_size=64, hidden_size=32, num_hidden_layers=4,
                                                  num_attention_heads=4, multi_query=True, parallel_attn=False)),
}
SHARD = "8KB"  # small enough that every model is split over several files


def _layer(name):
    m = re.search(r"\.(?:layers|h)\.(\d+)\.", name)
    return None if m is None else int(m.group(1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (folder, the model's state_dict as saved on disk)."""
    out = {}
    for i, (name, (config_cls, kw)) in enumerate(MODELS.items()):
        torch.manual_seed(i)
        model = getattr(transformers, config_cls.__name__.replace("Config", "ForCausalLM"))(config_cls(**kw))
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, max_shard_size=SHARD if name != "qwen3" else "1GB")
        files = [folder / f for f in os.listdir(folder) if f.endswith(".safetensors")]
        on_disk = {k: v for f in files for k, v in load_file(f).items()}
        out[name] = (folder, model.state_dict(), on_disk)
    return out


def _expected(state, num_layers, start, end, tied):
    want = {}
    for k, v in state.items():
        layer = _layer(k)
        if layer is None:
            final = k.startswith("lm_head") or "norm" in k or "ln_f" in k
            if (final and end == num_layers) or (not final and start == 0):
                want[k] = v
        elif start <= layer < end:
            want[k] = v
    if tied and end == num_layers:
        want["lm_head.weight"] = next(v for k, v in state.items() if "embed" in k)
    return want


@pytest.mark.parametrize("name", list(MODELS))
def test_stage_equals_saved_model(saved, name):
    folder, state, on_disk = saved[name]
    ckpt = open_checkpoint(folder)
    n = ckpt.config.num_layers
    if name != "qwen3":
        assert (folder / "model.safetensors.index.json").is_file()
    for start, end in [(0, n), (0, 1), (1, 3), (n - 2, n), (n - 1, n)]:
        got = load_stage_weights(ckpt, start, end)
        # The live model's names and tensors (its fused experts included), whatever the files hold.
        want = _expected(state, n, start, end, ckpt.config.tie_word_embeddings)
        assert sorted(got) == sorted(want), (start, end)
        for k in want:
            assert torch.equal(got[k], want[k]), k
            if k in on_disk:
                assert torch.equal(got[k], on_disk[k]), k


def test_moe_experts_stored_per_expert_come_back_fused(saved):
    folder, state, on_disk = saved["qwen3_moe"]
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in on_disk  # what transformers writes
    got = load_stage_weights(folder, 0, 4)
    for layer in (0, 2, 3):  # layer 1 is dense (mlp_only_layers)
        p = f"model.layers.{layer}.mlp.experts."
        assert p + "0.gate_proj.weight" not in got
        for e in range(4):
            gate, up = got[p + "gate_up_proj"][e].split(16)
            assert torch.equal(gate, on_disk[f"{p}{e}.gate_proj.weight"])
            assert torch.equal(up, on_disk[f"{p}{e}.up_proj.weight"])
            assert torch.equal(got[p + "down_proj"][e], on_disk[f"{p}{e}.down_proj.weight"])
        assert torch.equal(got[p + "gate_up_proj"], state[p + "gate_up_proj"])
    assert "model.layers.1.mlp.gate_proj.weight" in got


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_stage_reads_only_its_share(saved):
    folder, _, on_disk = saved["llama_untied"]
    ckpt = HFCheckpoint(folder)
    got = load_stage_weights(ckpt, 2, 4)
    layer_bytes = _nbytes(v for k, v in on_disk.items() if _layer(k) is not None)
    own = _nbytes(v for k, v in on_disk.items() if _layer(k) in (2, 3))
    assert ckpt.bytes_read == own == pytest.approx(layer_bytes * 2 / 6)
    assert not any("embed" in k or "lm_head" in k or k == "model.norm.weight" for k in got)


def test_tied_head_is_read_once(saved):
    folder, _, on_disk = saved["llama_tied"]
    ckpt = HFCheckpoint(folder)
    got = load_stage_weights(ckpt, 0, 6)
    assert got["lm_head.weight"] is got["model.embed_tokens.weight"]
    assert ckpt.bytes_read == _nbytes(on_disk.values())  # every stored tensor exactly once
    last = load_stage_weights(folder, 4, 6)
    assert "model.embed_tokens.weight" not in last
    assert torch.equal(last["lm_head.weight"], on_disk["model.embed_tokens.weight"])


@pytest.mark.parametrize("name, start, end", [("llama_tied", 0, 6), ("llama_untied", 2, 4),
                                               ("qwen3_moe", 0, 4), ("falcon_new", 3, 4)])
def test_progress_counts_add_up_to_the_bytes_read(saved, name, start, end):
    folder, _, on_disk = saved[name]
    ckpt = HFCheckpoint(folder)
    calls = []
    got = load_stage_weights(ckpt, start, end, progress=lambda *args: calls.append(args))
    total = len({id(t) for t in got.values()})  # a tied matrix is one tensor, read once
    assert calls[0] == (0, total, 0)
    assert [c[:2] for c in calls] == [(i, total) for i in range(total + 1)]
    # Each step adds one stored tensor's bytes (dtype "auto": the loaded tensors are the stored ones).
    steps = sorted(b - a for (_, _, a), (_, _, b) in zip(calls, calls[1:]))
    assert steps == sorted(v.numel() * v.element_size() for v in {id(t): t for t in got.values()}.values())
    assert calls[-1][2] == ckpt.bytes_read == sum(steps)
    if name == "llama_tied":  # the whole model: every stored tensor once
        assert calls[-1][2] == _nbytes(on_disk.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, "bfloat16"])
def test_dtype(saved, dtype):
    folder, _, on_disk = saved["qwen3"]
    got = load_stage_weights(folder, 1, 3, dtype=dtype)
    want = torch.bfloat16 if dtype == "bfloat16" else dtype
    for k, v in got.items():
        assert v.dtype == want and torch.equal(v, on_disk[k].to(want)), k
    assert all(v.dtype == torch.float32 for v in load_stage_weights(folder, 1, 3, dtype="auto").values())


def test_bad_arguments(saved):
    folder = saved["llama_untied"][0]
    for kw, match in [(dict(start_layer=3, end_layer=3), "layer range"), (dict(start_layer=0, end_layer=7), "layer range"),
                      (dict(start_layer=0, end_layer=1, tp_size=3), "tp=3 must divide num_attention_heads=4"),
                      (dict(start_layer=0, end_layer=1, tp_rank=2, tp_size=2), "tp_rank"),
                      (dict(start_layer=0, end_layer=1, dtype=torch.int8), "dtype")]:
        with pytest.raises(ValueError, match=match):
            load_stage_weights(folder, **kw)


@pytest.fixture
def broken(saved, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(saved["llama_untied"][0], folder)
    return folder


def test_missing_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        open_checkpoint(broken)


def _shards(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))


def test_missing_shard(broken):
    shard = _shards(broken)[1]
    (broken / shard).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(shard)):
        open_checkpoint(broken)


def test_index_names_missing_file(broken):
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "nowhere.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        open_checkpoint(broken)


def test_truncated_shard(broken):
    shard = broken / _shards(broken)[-1]
    os.truncate(shard, shard.stat().st_size - 10)
    with pytest.raises(ValueError, match=re.escape(shard.name) + ".*truncated"):
        open_checkpoint(broken)


def _drop(folder, name):
    """``folder`` without tensor ``name`` (its shard rewritten, the index updated)."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / index["weight_map"].pop(name)
    save_file({k: v for k, v in load_file(shard).items() if k != name}, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("model, name, layer", [
    ("llama_untied", "model.layers.2.mlp.up_proj.weight", 2),
    ("qwen3_moe", "model.layers.2.mlp.experts.1.up_proj.weight", 2),
])
def test_missing_tensor_is_named_and_other_stages_still_load(saved, tmp_path, model, name, layer):
    folder = tmp_path / model
    shutil.copytree(saved[model][0], folder)
    _drop(folder, name)
    table_name = "model.layers.2.mlp.experts.gate_up_proj" if "experts" in name else name
    with pytest.raises(ValueError, match=rf"needed by layers \[2, 3\) are missing: \[.{re.escape(table_name)}"):
        load_stage_weights(folder, layer, layer + 1)
    assert load_stage_weights(folder, 0, layer)  # a stage without that layer never looks for it


def test_shape_mismatch_names_tensor_and_shapes(broken):
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 40
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'model.layers.2.mlp.gate_proj.weight' has shape \[48, 32\].*\[40, 32\]"):
        load_stage_weights(broken, 2, 3)


def test_tokenizer_and_chat_template(broken):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(broken / "tokenizer.json"))
    (broken / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from config"}))
    ckpt = HFCheckpoint(broken)
    assert ckpt.tokenizer_path == broken / "tokenizer.json"
    assert ckpt.tokenizer().token_to_id("hi") == 0
    assert ckpt.chat_template == "from config"
    (broken / "chat_template.jinja").write_text("from jinja")
    assert HFCheckpoint(broken).chat_template == "from jinja"

"""The random models of `stagewise bench e2e --model random-...` (:mod:`stagewise.bench.e2e.random_models`),
at toy sizes through the builder the full-size ones take: the folder holds every tensor
transformers expects and nothing else, both sides load it, and ``--dtype bfloat16`` reaches ours,
transformers and the report."""

from __future__ import annotations

import dataclasses
import json
import tempfile

import pytest
import torch

from stagewise.api import Pipeline
from stagewise.bench.cli import main
from stagewise.bench.e2e import DTYPES, random_models
from stagewise.bench.e2e.baselines import load_transformers, run_transformers
from stagewise.bench.e2e.prompts import make_prompts
from stagewise.model.loader import open_checkpoint
from stagewise.model.loader.stage_weights import DTYPES as LOADER_DTYPES

transformers = pytest.importorskip("transformers")

TOY_LLAMA = dataclasses.replace(random_models.LLAMA3_8B, config={
    **random_models.LLAMA3_8B.config, "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 2})


def test_a_toy_llama_loads_in_stagewise_and_transformers_alike(tmp_path, monkeypatch):
    """Shards of at most SHARD_BYTES and their index, norms at one, the rest drawn at std 0.02, every
    key transformers expects; both sides greedy-decode the same tokens from it (float32 maths on its
    bfloat16 weights); a second call reuses the folder."""
    monkeypatch.setattr(random_models, "SHARD_BYTES", 40_000)
    model = TOY_LLAMA.with_layers(2)
    folder = random_models.build(model, root=tmp_path, log=lambda _: None)
    assert folder.name.startswith("stagewise-random-llama3-8b-2l-bfloat16-") and not list(tmp_path.glob("*.part-*"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    ckpt = open_checkpoint(str(folder))
    assert (ckpt.config.num_layers, ckpt.config.dtype, ckpt.config.rope.theta) == (2, torch.bfloat16, 500000.0)

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    params = dict(hf.named_parameters())
    assert torch.equal(params["model.layers.1.input_layernorm.weight"], torch.ones(64))
    assert params["lm_head.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert not torch.equal(params["lm_head.weight"], params["model.embed_tokens.weight"])

    prompts = make_prompts(ckpt, 2, 6)  # no tokenizer in the folder: fixed ids
    pipe = Pipeline(ckpt, dtype="float32", max_num_seqs=2, max_model_len=32)
    ours = [c.token_ids for c in pipe.generate(prompt_token_ids=prompts, max_new_tokens=5, ignore_eos=True)]
    theirs = run_transformers(load_transformers(ckpt, torch.float32, "cpu"), prompts, 5).token_ids
    assert ours == theirs

    again = random_models.build(model, root=tmp_path, log=pytest.fail)  # built once: nothing said, nothing written
    assert again == folder


def test_the_random_qwen3_vl_holds_every_tensor_transformers_expects(tmp_path):
    """The vision model through the same builder (a toy width): its keys are save_pretrained's."""
    text = {**random_models.QWEN3_VL.config["text_config"], "vocab_size": 128, "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
            "rope_parameters": dict(rope_type="default", rope_theta=5e6, mrope_section=[4, 2, 2], mrope_interleaved=True)}
    vision = {**random_models.QWEN3_VL.config["vision_config"], "depth": 2, "hidden_size": 32, "num_heads": 2,
              "intermediate_size": 48, "out_hidden_size": 64, "num_position_embeddings": 16,
              "deepstack_visual_indexes": [0, 1]}
    toy = dataclasses.replace(random_models.QWEN3_VL, config={**random_models.QWEN3_VL.config, "text_config": text,
                                                               "vision_config": vision, "image_token_id": 120,
                                                               "video_token_id": 121, "vision_start_token_id": 118,
                                                               "vision_end_token_id": 119}).with_layers(1)
    folder = random_models.build(toy, root=tmp_path, log=lambda _: None)
    _, info = transformers.AutoModelForImageTextToText.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    assert open_checkpoint(str(folder)).config.vision_config is not None


def test_e2e_random_llama_in_bfloat16(tmp_path, monkeypatch):
    """`--model random-llama3-8b --random-layers 1 --dtype bfloat16` (its shape made a toy's): built
    in the temp folder, both sides in bfloat16, the int8 mode skipped (it multiplies in float32)."""
    monkeypatch.setitem(random_models.MODELS, "random-llama3-8b", TOY_LLAMA)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "results"
    argv = ["e2e", "--model", "random-llama3-8b", "--random-layers", "1", "--dtype", "bfloat16", "--batch-sizes", "2",
            "--prompt-len", "5", "--new-tokens", "3", "--repeats", "1", "--threads", "1", "--tiny", "--out", str(out)]
    assert main(argv) == 0
    [folder] = tmp_path.glob("stagewise-random-llama3-8b-1l-bfloat16-*")
    [js] = out.glob("*-e2e-t1.json")
    machine = json.loads(js.read_text())["machine"]
    assert (machine["model"], machine["dtype"]) == (str(folder), "bfloat16")
    assert machine["baselines"]["transformers"]["dtype"] == "bfloat16"
    assert (machine["linear_precisions"], machine["skipped_precisions"]) == (["exact"], ["int8"])
    assert "bfloat16 activations" in js.with_suffix(".md").read_text()


@pytest.mark.parametrize("argv, error", [
    (["--model", "smollm2-135m", "--random-layers", "2"], "--random-layers applies to the random models"),
    (["--model", "random-llama3-8b", "--random-layers", "0"], "--random-layers must be an int >= 1, got 0"),
])
def test_random_layers_errors(argv, error, tmp_path, capsys):
    assert main(["e2e", *argv, "--tiny", "--out", str(tmp_path)]) == 2
    assert error in capsys.readouterr().err


def test_dtype_choices_are_the_loaders():
    assert set(DTYPES) == set(LOADER_DTYPES)

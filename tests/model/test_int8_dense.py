"""The int8 mode over a dense checkpoint: its float32 matmul weights quantised to Q8_0 blocks at
load, bit for bit as the GGUF project's own quantiser does it (the same blocks a llama.cpp
conversion writes), and multiplied by int8 activations through the int8 kernels; what stays dense
and what is refused."""

from __future__ import annotations

import gguf
import pytest
import torch

from helpers.quant_cases import checked_int8_linear
import stagewise
from stagewise.model.loader import load_stage_weights
from stagewise.model.quant import QuantizedWeight, quantize_q8_0

transformers = pytest.importorskip("transformers")

# down_proj reads the 80-wide MLP: not whole blocks of 32, so it stays dense.
SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=80, max_position_embeddings=64)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)).eval()
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return path


def test_matmul_weights_become_the_gguf_quantisers_q8_0_blocks(folder):
    exact = load_stage_weights(folder, 0, 2, dtype="float32")
    int8 = load_stage_weights(folder, 0, 2, dtype="float32", linear_precision="int8")
    quantised = {n for n, w in int8.items() if isinstance(w, QuantizedWeight)}
    assert quantised == {n for n in exact if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                         "o_proj.weight", "gate_proj.weight", "up_proj.weight"))
                         } | {"lm_head.weight"}
    for name in quantised:
        w = int8[name]
        assert (w.qtype_name, w.precision, tuple(w.shape)) == ("Q8_0", "int8", tuple(exact[name].shape))
        blocks = gguf.quants.quantize(exact[name].numpy(), gguf.GGMLQuantizationType.Q8_0)
        assert torch.equal(w.data, torch.from_numpy(blocks))
    for name in set(exact) - quantised:  # embedding, norms, the 80-wide down_proj
        assert isinstance(int8[name], torch.Tensor) and torch.equal(int8[name], exact[name])
    assert "model.layers.0.mlp.down_proj.weight" not in quantised


def test_the_model_multiplies_int8_activations_by_those_blocks(folder, monkeypatch):
    """Each call of a quantised linear agrees with the pure-torch reference of the int8 maths (and
    not with the exact maths); the tokens are deterministic, in one process and over two stages."""
    linear, seen = QuantizedWeight.linear, set()
    checked = checked_int8_linear(seen)

    prompts = [[5, 9, 14, 3, 77, 21, 40], [8, 1, 4]]
    with stagewise.Pipeline(str(folder), dtype="float32", linear_precision="int8") as pipe:
        monkeypatch.setattr(QuantizedWeight, "linear", checked)
        one = [c.token_ids for c in pipe.generate(prompt_token_ids=prompts, max_new_tokens=5, ignore_eos=True)]
        monkeypatch.setattr(QuantizedWeight, "linear", linear)
    assert ("int8", (SMALL["vocab_size"], SMALL["hidden_size"])) in seen  # the LM head
    with stagewise.Pipeline(str(folder), dtype="float32", linear_precision="int8", stages=2) as pipe:
        two = [c.token_ids for c in pipe.generate(prompt_token_ids=prompts, max_new_tokens=5, ignore_eos=True)]
    assert one == two and all(len(t) == 5 for t in one)


def test_what_cannot_be_quantised_is_named(folder):
    with pytest.raises(ValueError, match=r"int8 activations in float32.*layers \[0, 2\) of .* have neither"):
        load_stage_weights(folder, 0, 2, dtype="bfloat16", linear_precision="int8")
    with pytest.raises(ValueError, match=r"in a multiple of 32, got torch.float32 \[4, 40\]"):
        quantize_q8_0(torch.zeros(4, 40))

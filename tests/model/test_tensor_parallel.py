"""Tensor parallel inside a stage, for real: ``tp`` rank processes over gloo (tests/helpers/tp_ranks.py),
each loading its shard of a checkpoint saved to disk, run the same prefill and decode steps; rank
0's logits must equal the single-process stage's and transformers' (float32, 1e-4), its argmax the
single process's greedy tokens, and the other ranks' last stage must return None. Every case of a
tp size runs in one world (one process per rank) to keep the process count small. Also: the
collectives each step makes (one all-reduce per layer half, one per Falcon parallel layer, the
embedding's, the logits' gather), what a rank reads, bad tp sizes, and a failing rank."""

from __future__ import annotations

import socket
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from stagewise.model.collectives import StageGroups  # noqa: E402
from stagewise.model.hf_config import parse_hf_config  # noqa: E402
from stagewise.model.loader import open_checkpoint  # noqa: E402
from stagewise.model.stage import StageModel, load_stage  # noqa: E402

from helpers.gguf_files import gguf_as_hf, write_gguf  # noqa: E402
from helpers.groups import NoCollectives  # noqa: E402
from helpers.tp_ranks import (JOINS, NUM_STEPS, WorldFailed, check_steps, hf_step_logits, load_stages, prompts,  # noqa: E402
                              run_steps, run_world)

TOL = dict(rtol=1e-4, atol=1e-4)  # float32; the ranks' partial sums add in another order than one matmul
# vocab 97 is odd: the last vocab-parallel rank holds padding rows at tp 2 and 4.
SMALL = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, max_position_embeddings=64)
MODELS = {
    # GQA 8:2 with biases (a row-parallel bias counts once): KV heads split at tp 2, replicated at tp 4.
    "llama-gqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96, attention_bias=True,
        mlp_bias=True)),
    # MQA, tied, as two pipeline stages: the last stage's head is its own copy of the embedding rows.
    "llama-mqa-tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=1, intermediate_size=96, tie_word_embeddings=True)),
    # q/k norms; tied on one stage: one matrix for the embedding and the head.
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
        tie_word_embeddings=True)),
    # q/k/v biases (not o, not the MLP), tied, over three stages: the last holds its own head copy.
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=True)),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        tie_word_embeddings=False)),
    "falcon-7b": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(  # parallel, multi-query
        **SMALL, num_attention_heads=4, new_decoder_architecture=False, multi_query=True, parallel_attn=True,
        bias=True, ffn_hidden_size=128)),
    "falcon-40b": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(  # parallel, grouped, 2 norms
        **SMALL, num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2, bias=True,
        ffn_hidden_size=128, tie_word_embeddings=False)),
    "falcon-rw": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(  # sequential
        **SMALL, num_attention_heads=4, new_decoder_architecture=False, multi_query=False, parallel_attn=False,
        bias=True)),
}
CUTS = {"llama-mqa-tied": [1], "qwen2": [1, 2], "gguf-qwen2": [2]}
# Every matrix, the embedding and the head in Q8_0 blocks; 128 = 2 * 64 so the down cut keeps whole blocks.
GGUF_TYPES = {f"blk.{i}.{t}.weight": Q.Q8_0 for i in range(3)
              for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
GGUF_TYPES.update({"token_embd.weight": Q.Q8_0, "output.weight": Q.Q8_0})
GGUF = {"gguf-q8": "llama", "gguf-qwen2": "qwen2"}
"""GGUF cases: the architecture of the tiny file (every weight moved off its init for qwen2's biases)."""
WORLDS = {2: [*MODELS, *GGUF], 4: ["llama-gqa", "falcon-40b"]}


def _hf_model(name):
    torch.manual_seed(0)
    hf = MODELS[name]().eval()
    with torch.no_grad():  # every weight (norms at 1, biases at 0 included) off its init value
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return hf


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """name -> case: its checkpoint on disk, prompts, the single process's logits and greedy tokens,
    transformers' logits."""
    out = {}
    for name in [*MODELS, *GGUF]:
        folder = tmp_path_factory.mktemp(name)
        if name in GGUF:
            write_gguf(folder / "m.gguf", GGUF[name], types=GGUF_TYPES, intermediate=128,
                       perturbed=name == "gguf-qwen2")
            checkpoint, hf = folder / "m.gguf", gguf_as_hf(folder / "m.gguf")
        else:
            hf = _hf_model(name)
            hf.save_pretrained(folder)
            checkpoint = folder
        case = dict(name=name, checkpoint=str(checkpoint), cuts=CUTS.get(name, []))
        ps = prompts(open_checkpoint(checkpoint).config.vocab_size)
        logits, tokens = run_steps(load_stages(case), ps)
        out[name] = dict(case, prompts=ps, tokens=tokens, logits=logits, hf=hf_step_logits(hf, ps, tokens))
    return out


@pytest.fixture(scope="module")
def worlds(cases, tmp_path_factory):
    """tp -> (rank 0's logits, every rank's counts) of one world running all of its cases."""
    out = {}
    for tp, names in WORLDS.items():
        sent = [{k: cases[n][k] for k in ("name", "checkpoint", "cuts", "prompts", "tokens")} for n in names]
        out[tp] = run_world(sent, tp, tmp_path_factory.mktemp(f"tp{tp}"), timeout_s=120)
    return out


PARAMS = [(tp, name) for tp, names in WORLDS.items() for name in names]


@pytest.mark.parametrize("tp,name", PARAMS)
def test_rank0_logits_match_one_process_and_transformers(cases, worlds, tp, name):
    case, (logits, counts) = cases[name], worlds[tp]
    check_steps(case, logits, name, TOL)
    assert counts[0][name]["none"] == [False] * NUM_STEPS
    for rank in range(1, tp):  # the other ranks' last stage returns None
        assert counts[rank][name]["none"] == [True] * NUM_STEPS


def _layer_reduces(cfg) -> int:
    """All-reduces of one decoder layer: after attention and after the MLP, or once for both when
    Falcon runs them in parallel."""
    return 1 if cfg.architecture == "falcon" and cfg.arch.parallel_attn else 2


@pytest.mark.parametrize("tp,name", PARAMS)
def test_collectives_per_step(cases, worlds, tp, name):
    """Each step: the embedding's all-reduce, the layers' all-reduces and the logits' gather; the C++
    decode loop (which cannot all-reduce) never runs on a TP rank."""
    cfg = open_checkpoint(cases[name]["checkpoint"]).config
    want = 1 + cfg.num_layers * _layer_reduces(cfg) + 1
    for rank_counts in worlds[tp][1]:
        assert rank_counts[name]["calls"] == [want] * NUM_STEPS
        assert not rank_counts[name]["decode_stack"]


def test_bytes_of_a_decode_step(cases, worlds):
    """docs/model.md's count for Llama at tp 2: ``(1 + 2 L) T h`` floats all-reduced, ``R ceil(V / tp)``
    gathered (what each rank hands to the collectives)."""
    cfg = open_checkpoint(cases["llama-gqa"]["checkpoint"]).config
    rows = len(JOINS)  # the last step decodes one token of every request
    want = 4 * ((1 + 2 * cfg.num_layers) * rows * cfg.hidden_size + rows * -(-cfg.vocab_size // 2))
    assert all(c["llama-gqa"]["bytes"][-1] == want for c in worlds[2][1])


# ---- bad input, in one process: every check comes before any collective or read ----------------


def _config(**kw):
    return parse_hf_config(transformers.LlamaConfig(**{**SMALL, "intermediate_size": 96, **kw}).to_dict())


def test_tp_must_divide_the_query_heads(cases):
    with pytest.raises(ValueError, match=r"tp=3 must divide num_attention_heads=8 \(each rank runs whole query heads\); "
                                         r"valid tp sizes for this model: \[1, 2, 4, 8\]"):
        StageModel.from_weights(_config(num_attention_heads=8, num_key_value_heads=2), 0, 3, {},
                                groups=StageGroups(tp=NoCollectives(3)))
    ckpt = open_checkpoint(cases["llama-gqa"]["checkpoint"])
    with pytest.raises(ValueError, match="tp=3 must divide num_attention_heads=8"):
        load_stage(ckpt, 0, 3, groups=StageGroups(tp=NoCollectives(3)))
    assert ckpt.bytes_read == 0


def test_kv_heads_must_be_split_or_replicated_whole():
    cfg = _config(hidden_size=96, num_attention_heads=12, num_key_value_heads=4)
    for tp in (3, 6):  # 4 KV heads neither split into 3 or 6 nor shared evenly by them
        with pytest.raises(ValueError, match=rf"tp={tp} and num_key_value_heads=4 must divide one another .*"
                                             r"valid tp sizes for this model: \[1, 2, 4, 12\]"):
            StageModel.from_weights(cfg, 0, 3, {}, groups=StageGroups(tp=NoCollectives(tp)))


def test_quantized_row_cut_must_keep_whole_blocks(tmp_path):
    """The default tiny GGUF stores blk.1.ffn_down [64, 96] in Q8_0: two ranks would cut its 96 inputs
    at 48, inside a block of 32."""
    write_gguf(tmp_path / "m.gguf")
    ckpt = open_checkpoint(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=r"tensor 'model.layers.1.mlp.down_proj.weight' \[64, 96\], stored as Q8_0 "
                                         r"in blocks of 32 weights; a cut must fall on block boundaries"):
        load_stage(ckpt, 0, 3, groups=StageGroups(tp=NoCollectives(2, rank=1)))
    assert ckpt.bytes_read == 0


def test_vocab_rows_must_be_the_ranks_share():
    from stagewise.model.layers.vocab import LMHead, VocabEmbedding

    for layer in (VocabEmbedding, LMHead):
        with pytest.raises(ValueError, match=r"TP rank 1 of 2 must hold ceil\(97 / 2\) = 49 rows of the vocabulary, "
                                             r"got a weight of \[97, 8\]"):
            layer(torch.zeros(97, 8), 97, NoCollectives(2, rank=1))


# ---- a failing rank -------------------------------------------------------------------------------

def test_a_failing_rank_stops_the_world(cases, tmp_path):
    """Rank 1 fails after joining; rank 0 would wait in its first collective: it is killed (or fails
    itself when gloo sees rank 1 gone), both are reaped, the store's port is closed, and the error
    names rank 1 and shows its output."""
    case = {k: cases["qwen3"][k] for k in ("name", "checkpoint", "cuts", "prompts", "tokens")}
    start = time.monotonic()
    with pytest.raises(WorldFailed, match=r"(?s)rank 1 exited with 1.*the end of rank 1's output:.*RuntimeError: rank 1 fails on purpose") as failed:
        run_world([case], 2, tmp_path, timeout_s=60, fail_rank=1)
    assert time.monotonic() - start < 30
    for pid in failed.value.pids:
        with pytest.raises(ChildProcessError):  # reaped: no longer this process's child
            __import__("os").waitpid(pid, 0)
    with pytest.raises(OSError):
        socket.create_connection(failed.value.address, timeout=2).close()

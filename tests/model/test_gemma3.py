"""Gemma 3 (text) beyond test_models.py (which holds it to transformers in one process and in 2 and 3
stages): loaded from safetensors and from a GGUF file written as llama.cpp's converter writes it
(its names, every norm plus 1), each against transformers, in one process and at tp 2 (rank
processes over gloo, one world for both); its config in both of transformers' forms, and what it
refuses; what the planner counts of its sliding layers. Float32, tiny random models; sliding
layers with a window shorter than the sequences and a rope base of their own."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from stagewise.model import shapes  # noqa: E402
from stagewise.model.architectures import gemma3  # noqa: E402
from stagewise.model.hf_config import parse_hf_config  # noqa: E402
from stagewise.model.loader import load_stage_weights, open_checkpoint  # noqa: E402
from stagewise.parallel.plan import StagePlan  # noqa: E402
from stagewise.planner import compute, estimate, memory  # noqa: E402

from helpers.gguf_files import TOKENS, add_tensor, add_tokenizer, finish, gguf_as_hf  # noqa: E402
from helpers.tp_ranks import (NUM_STEPS, check_steps, hf_step_logits, load_stages, prompts, run_steps,  # noqa: E402
                              run_world)

TOL = dict(rtol=1e-4, atol=1e-4)
SIZES = dict(vocab_size=len(TOKENS), hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, max_position_embeddings=64, sliding_window=3)
SAFETENSORS = dict(  # layer types and both ropes given, a score scale other than head_dim's
    num_hidden_layers=3, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention"],
    rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                     "full_attention": dict(rope_type="linear", rope_theta=1e4, factor=2.0)})
# What llama.cpp can say: the default pattern (6: layer 5 of 7 is full), the local base fixed at
# 10000, query_pre_attn_scalar = head_dim; the full layers' base and linear scaling in its metadata.
GGUF_MODEL = dict(num_hidden_layers=7, query_pre_attn_scalar=16, rope_theta=5e4,
                  rope_scaling=dict(rope_type="linear", factor=2.0))
GGUF_NAMES = {v: k for k, v in gemma3.GGUF_LAYER_NAMES.items()}
GGUF_TYPES = {"blk.0.attn_v.weight": Q.F16, "blk.1.ffn_up.weight": Q.Q8_0, "blk.5.attn_q.weight": Q.Q8_0}


def _hf_model(**kw):
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**SIZES, **kw)).eval()
    with torch.no_grad():  # every weight (norms at 0 included) off its init value
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return hf


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def write_gemma3_gguf(path, hf) -> None:
    """``hf`` as llama.cpp's convert_hf_to_gguf writes a Gemma 3 text model: tied (no output.weight),
    every ``*norm.weight`` stored plus 1, Q/K as HF has them."""
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(cfg.rope_parameters["full_attention"]["factor"])
    w.add_sliding_window(cfg.sliding_window)
    add_tokenizer(w)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        g = _gguf_name(name)
        data = (tensor + 1 if name.endswith("norm.weight") else tensor).numpy()
        add_tensor(w, g, data, GGUF_TYPES.get(g, Q.F32))
    finish(w)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """name -> its checkpoint, prompts, the single process's logits and greedy tokens, transformers'
    logits and greedy continuation."""
    out = {}
    for name in ("safetensors", "gguf"):
        folder = tmp_path_factory.mktemp(f"gemma3-{name}")
        if name == "gguf":
            write_gemma3_gguf(folder / "m.gguf", _hf_model(**GGUF_MODEL))
            checkpoint, hf = folder / "m.gguf", gguf_as_hf(folder / "m.gguf")
        else:
            hf = _hf_model(**SAFETENSORS)
            hf.save_pretrained(folder)
            checkpoint = folder
        case = dict(name=name, checkpoint=str(checkpoint), cuts=[1] if name == "gguf" else [])
        ps = prompts(SIZES["vocab_size"])
        logits, tokens = run_steps(load_stages(case), ps)
        out[name] = dict(case, prompts=ps, tokens=tokens, logits=logits, hf=hf_step_logits(hf, ps, tokens), model=hf)
    return out


@pytest.fixture(scope="module")
def tp2(cases, tmp_path_factory):
    sent = [{k: c[k] for k in ("name", "checkpoint", "cuts", "prompts", "tokens")} for c in cases.values()]
    return run_world(sent, 2, tmp_path_factory.mktemp("gemma3-tp2"), timeout_s=120)


def test_the_gguf_file_is_read_as_llama_cpp_reads_it(cases):
    cfg = open_checkpoint(cases["gguf"]["checkpoint"]).config
    own = cfg.arch
    assert own.sliding_layers == (0, 1, 2, 3, 4, 6) and cfg.sliding_window == 3
    assert own.local_rope.theta == 1e4 and (cfg.rope.theta, cfg.rope.type, cfg.rope.factor) == (5e4, "linear", 2.0)
    assert own.query_pre_attn_scalar == 16 and cfg.activation == "gelu_pytorch_tanh" and cfg.tie_word_embeddings
    # The norms come back as HF holds them: the stored value less one (float32: within an ulp of 1).
    ckpt = open_checkpoint(cases["gguf"]["checkpoint"])
    weights = load_stage_weights(ckpt, 0, 1, quantized=False)
    original = _hf_model(**GGUF_MODEL).state_dict()
    for name in ("model.layers.0.post_feedforward_layernorm.weight", "model.layers.0.self_attn.k_norm.weight"):
        torch.testing.assert_close(weights[name], original[name], rtol=0, atol=2**-23)


@pytest.mark.parametrize("name", ["safetensors", "gguf"])
def test_one_process_matches_transformers(cases, name):
    """Logits of every step (prefills and decodes mixed) and greedy decoding token for token."""
    case = cases[name]
    for step in range(NUM_STEPS):
        torch.testing.assert_close(case["logits"][step], case["hf"][step], **TOL, msg=lambda m: f"step {step}: {m}")
    hf = case["model"]
    for p, got in zip(case["prompts"], case["tokens"]):
        expected = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=len(got), min_new_tokens=len(got), do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got == expected, (p, got, expected)


@pytest.mark.parametrize("name", ["safetensors", "gguf"])
def test_tp2_matches_one_process_and_transformers(cases, tp2, name):
    case, (logits, counts) = cases[name], tp2
    check_steps(case, logits, name, TOL)
    assert counts[1][name]["none"] == [True] * NUM_STEPS


# ---- config ---------------------------------------------------------------------------------------

def test_classic_keys_mean_what_transformers_5_keys_do():
    """A hub file of transformers 4 (rope_theta, rope_scaling, rope_local_base_freq,
    sliding_window_pattern) parses as transformers 5's form of the same config."""
    classic = dict(model_type="gemma3_text", **SIZES, num_hidden_layers=4, rope_theta=5e5, rope_local_base_freq=1e3,
                   rope_scaling=dict(rope_type="linear", factor=8.0), sliding_window_pattern=2)
    new = transformers.Gemma3TextConfig(**{k: v for k, v in classic.items() if k != "model_type"})
    cfg = parse_hf_config(classic)
    assert cfg == parse_hf_config(new.to_dict())
    assert cfg.arch.sliding_layers == (0, 2) and cfg.arch.local_rope.theta == 1e3
    assert (cfg.rope.theta, cfg.rope.type, cfg.rope.factor) == (5e5, "linear", 8.0)


@pytest.mark.parametrize("changes, message", [
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 is not supported"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True is not supported"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "field 'layer_types' must list"),
    (dict(sliding_window_pattern=0), "field 'sliding_window_pattern' must be an int >= 1"),
    (dict(rope_parameters={"full_attention": {"rope_theta": 1e6}, "local": {"rope_theta": 1e4}}),
     r"field 'rope_parameters' has \['local'\]"),
])
def test_what_it_refuses_is_named(changes, message):
    hf = dict(model_type="gemma3_text", vocab_size=10, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=8, **changes)
    with pytest.raises(ValueError, match=rf"config.json: {message}"):
        parse_hf_config(hf)


def test_the_multimodal_model_type_is_refused():
    with pytest.raises(ValueError, match=r"model_type 'gemma3' is not supported"):
        parse_hf_config(dict(model_type="gemma3", text_config={}, vision_config={}))


# ---- the planner ----------------------------------------------------------------------------------

def test_the_planner_counts_the_window_of_sliding_layers_only(cases):
    cfg = open_checkpoint(cases["safetensors"]["checkpoint"]).config
    stage = StagePlan.build(cfg.num_layers, 1).stages[0]
    ops = compute.stage_ops(cfg, stage, rows=1, new_tokens=1, context=40)
    attn = {o.layer: o for o in ops if o.name == "attention"}
    per_pair = 4 * cfg.num_heads * cfg.head_dim
    assert [attn[i].flops for i in range(3)] == [per_pair * 3, per_pair * 41, per_pair * 3]
    prefill = {o.layer: o for o in compute.stage_ops(cfg, stage, rows=1, new_tokens=10, context=0)
               if o.name == "attention"}
    assert prefill[0].flops == per_pair * (1 + 2 + 3 * 8) and prefill[1].flops == per_pair * 55
    # Its four norms: two more than a pre-norm layer's, after attention and after the MLP.
    names = [o.name for o in ops if o.layer == 0]
    assert names.index("o_proj") < names.index("attn_out_norm") and names[-1] == "mlp_out_norm"
    # KV: a sliding layer keeps its window's tokens, as the cache does (it gives the others' blocks back).
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert memory.kv_bytes(cfg, range(cfg.num_layers), tokens=40) == per_token * (3 + 40 + 3)
    assert memory.kv_bytes(cfg, range(1, 3), tokens=2, batch=5) == per_token * 5 * (2 + 2)
    with pytest.raises(ValueError, match=r"layers \[0, 2\] attend over a sliding window, which context parallel "
                                         r"\(pcp=1, dcp=2\) does not shard"):
        memory.check_layout(cfg, shapes.Sharding(tp=2, dcp=2))


def test_the_planner_times_the_python_layer_loop_of_windowed_models(cases):
    """As StageModel.python_loop_reason: a window (Mistral's, Gemma's) keeps the C++ loop off."""
    from helpers.hf_models import make_model

    gemma = open_checkpoint(cases["safetensors"]["checkpoint"]).config
    _, mistral = make_model("mistral-window")
    one = shapes.Sharding()
    assert estimate.runs_python_loop(gemma, one) and estimate.runs_python_loop(mistral, one)
    assert not estimate.runs_python_loop(mistral.replace(sliding_window=None), one)
    assert not estimate.runs_python_loop(mistral.replace(sliding_window=mistral.max_position_embeddings), one)
    assert estimate.runs_python_loop(mistral.replace(sliding_window=None), shapes.Sharding(tp=2))

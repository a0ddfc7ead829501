"""ModelConfig parsing: real config.json files, transformers round trips, and refusals.

Expected values come from the JSON files themselves or from the transformers
config objects that wrote them, never from numbers typed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stagewise.model import ModelConfig
from stagewise.model import architectures
from stagewise.model.architectures import MODEL_TYPES
from stagewise.model.architectures.falcon import FalconLayout
from stagewise.model.hf_config import parse_config_file, parse_hf_config

transformers = pytest.importorskip("transformers")

_REPO = Path(__file__).resolve().parents[2]
# CI clones the repository with shared/ beside it; a device checkout carries it inside.
_CONFIG_DIRS = [_REPO / ".." / "shared" / "configs", _REPO / "shared" / "configs"]
CONFIGS = next((d.resolve() for d in _CONFIG_DIRS if d.is_dir()), None)
needs_configs = pytest.mark.skipif(CONFIGS is None, reason=f"shared configs not found at any of {_CONFIG_DIRS}")

SMALL = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, max_position_embeddings=512)


def _load(name: str) -> tuple[dict, ModelConfig]:
    path = CONFIGS / name
    return json.loads(path.read_text()), parse_config_file(path)


def _eos(value) -> tuple[int, ...]:
    return () if value is None else tuple(value) if isinstance(value, list) else (value,)


@needs_configs
def test_qwen3_4b_matches_its_json():
    hf, cfg = _load("qwen3-4b.json")
    assert cfg.architecture == "qwen3" and cfg.qk_norm and cfg.arch is None
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (
        hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"])
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"])
    assert cfg.intermediate_size == hf["intermediate_size"]
    assert cfg.norm_eps == hf["rms_norm_eps"] and cfg.activation == hf["hidden_act"]
    assert cfg.rope.theta == hf["rope_theta"] and cfg.rope.type == "default"
    assert cfg.rotary_dim == hf["head_dim"]
    assert cfg.max_position_embeddings == hf["max_position_embeddings"]
    assert cfg.tie_word_embeddings == hf["tie_word_embeddings"]
    assert cfg.qkv_bias == cfg.o_bias == hf["attention_bias"] and not cfg.mlp_bias
    assert cfg.bos_token_id == hf["bos_token_id"] and cfg.eos_token_ids == _eos(hf["eos_token_id"])
    assert cfg.dtype == getattr(torch, hf["torch_dtype"])
    assert cfg.moe is None and not any(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert not cfg.is_multimodal and cfg.vision_config is None


@needs_configs
def test_falcon_40b_matches_its_json():
    hf, cfg = _load("falcon-40b.json")
    assert cfg.architecture == "falcon" and not cfg.qk_norm
    assert cfg.arch.new_decoder_architecture == hf["new_decoder_architecture"] is True
    assert cfg.num_kv_heads == hf["num_kv_heads"]  # the 40B layout groups KV heads
    assert cfg.arch.parallel_attn and cfg.arch.num_ln_in_parallel_attn == 2
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads) == (
        hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"])
    assert cfg.head_dim * cfg.num_heads == hf["hidden_size"]
    assert cfg.intermediate_size == 4 * hf["hidden_size"]  # no ffn_hidden_size: Falcon's 4x default
    assert cfg.norm_eps == hf["layer_norm_epsilon"]
    assert cfg.qkv_bias == cfg.o_bias == cfg.mlp_bias == hf["bias"]
    assert cfg.vocab_size == hf["vocab_size"] and cfg.max_position_embeddings == hf["max_position_embeddings"]
    assert cfg.bos_token_id == hf["bos_token_id"] and cfg.eos_token_ids == _eos(hf["eos_token_id"])
    assert cfg.dtype == getattr(torch, hf["torch_dtype"])


@needs_configs
def test_qwen3_vl_moe_parses_its_text_model():
    hf, cfg = _load("qwen3-vl-235b-a22b.json")
    text = hf["text_config"]
    assert cfg.architecture == "qwen3_moe" and cfg.is_multimodal
    vision = hf["vision_config"]
    for key in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "patch_size",
                "temporal_patch_size", "spatial_merge_size", "num_position_embeddings", "in_channels"):
        assert getattr(cfg.vision_config, key) == vision[key], key
    assert cfg.vision_config.deepstack_visual_indexes == tuple(vision["deepstack_visual_indexes"])
    assert (cfg.vision_config.image_token_id, cfg.vision_config.vision_start_token_id,
            cfg.vision_config.vision_end_token_id) == (hf["image_token_id"], hf["vision_start_token_id"],
                                                       hf["vision_end_token_id"])
    for ours, theirs in [("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers"),
                         ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
                         ("head_dim", "head_dim"), ("intermediate_size", "intermediate_size"),
                         ("vocab_size", "vocab_size"), ("moe.num_experts", "num_experts"),
                         ("moe.num_experts_per_tok", "num_experts_per_tok"),
                         ("moe.intermediate_size", "moe_intermediate_size"),
                         ("moe.norm_topk_prob", "norm_topk_prob"), ("moe.decoder_sparse_step", "decoder_sparse_step"),
                         ("norm_eps", "rms_norm_eps"), ("max_position_embeddings", "max_position_embeddings")]:
        owner, _, name = ours.rpartition(".")
        assert getattr(cfg.moe if owner else cfg, name) == text[theirs], ours
    assert cfg.moe.mlp_only_layers == tuple(text["mlp_only_layers"])
    assert cfg.rope.theta == text["rope_theta"]
    assert cfg.rope.mrope_section == tuple(text["rope_scaling"]["mrope_section"])
    assert cfg.rope.mrope_interleaved == text["rope_scaling"]["mrope_interleaved"]
    assert cfg.tie_word_embeddings == hf["tie_word_embeddings"]
    assert cfg.dtype == getattr(torch, text["dtype"])
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def _check_common(cfg: ModelConfig, t) -> None:
    """Fields every architecture shares, against the transformers config object ``t``."""
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads) == (
        t.vocab_size, t.hidden_size, t.num_hidden_layers, t.num_attention_heads)
    assert cfg.max_position_embeddings == t.max_position_embeddings
    assert cfg.tie_word_embeddings == t.tie_word_embeddings
    assert cfg.bos_token_id == t.bos_token_id and cfg.eos_token_ids == _eos(t.eos_token_id)
    assert cfg.rope.theta == t.rope_parameters["rope_theta"] and cfg.rope.type == t.rope_parameters["rope_type"]


def _round_trip(t, tmp_path: Path, how: str) -> ModelConfig:
    if how == "dict":
        return parse_hf_config(t.to_dict())
    t.save_pretrained(tmp_path)
    return parse_config_file(tmp_path)


ROPES = [
    None,
    dict(rope_type="linear", rope_theta=5e5, factor=2.0),
    dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=128),
    dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=128),
]


@pytest.mark.parametrize("how", ["dict", "file"])
@pytest.mark.parametrize("rope", ROPES, ids=["default", "linear", "llama3", "yarn"])
def test_llama_round_trip(tmp_path, how, rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    t = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, intermediate_size=96, rope_parameters=rope,
                                 attention_bias=True, mlp_bias=True, eos_token_id=[2, 5], dtype="float16")
    cfg = _round_trip(t, tmp_path, how)
    _check_common(cfg, t)
    assert cfg.architecture == "llama" and not cfg.qk_norm and cfg.arch is None
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (
        t.num_key_value_heads, t.head_dim, t.intermediate_size)
    assert cfg.norm_eps == t.rms_norm_eps and cfg.activation == t.hidden_act
    assert cfg.qkv_bias == cfg.o_bias == t.attention_bias and cfg.mlp_bias == t.mlp_bias
    assert cfg.dtype == torch.float16
    # The rope factor transformers will scale cos/sin by, and the parameters it reads.
    assert cfg.rope.attention_factor == pytest.approx(LlamaRotaryEmbedding(t).attention_scaling, rel=1e-12)
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key in t.rope_parameters:
            assert getattr(cfg.rope, key) == t.rope_parameters[key], key


def test_mistral_is_llama_with_its_window():
    t = transformers.MistralConfig(**SMALL, num_key_value_heads=4, intermediate_size=96, sliding_window=64)
    cfg = parse_hf_config(t.to_dict())
    _check_common(cfg, t)
    assert cfg.architecture == "llama" and cfg.sliding_window == t.sliding_window
    assert (cfg.num_kv_heads, cfg.head_dim) == (t.num_key_value_heads, t.head_dim)


@pytest.mark.parametrize("how", ["dict", "file"])
def test_qwen2_round_trip(tmp_path, how):
    """Qwen2.5's shape: q/k/v biases (o and the MLP none), tied, rope theta 1e6, its sliding-window
    keys present but off."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP

    t = transformers.Qwen2Config(**SMALL, num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=True,
                                 rms_norm_eps=1e-6, rope_parameters=dict(rope_theta=1e6), sliding_window=32,
                                 max_window_layers=2, use_sliding_window=False)
    cfg = _round_trip(t, tmp_path, how)
    _check_common(cfg, t)
    assert cfg.architecture == "qwen2" and not cfg.qk_norm and cfg.sliding_window is None
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (
        t.num_key_value_heads, t.hidden_size // t.num_attention_heads, t.intermediate_size)
    attn, mlp = Qwen2Attention(t, 0), Qwen2MLP(t)  # the biases as transformers' own modules have them
    assert cfg.qkv_bias == (attn.q_proj.bias is not None) == (attn.k_proj.bias is not None) is True
    assert cfg.o_bias == (attn.o_proj.bias is not None) is False
    assert cfg.mlp_bias == (mlp.down_proj.bias is not None) is False


@pytest.mark.parametrize("how", ["dict", "file"])
def test_qwen3_round_trip(tmp_path, how):
    t = transformers.Qwen3Config(**SMALL, num_key_value_heads=4, head_dim=16, intermediate_size=96,
                                 tie_word_embeddings=True, rms_norm_eps=1e-5, rope_parameters=dict(rope_theta=1e6))
    cfg = _round_trip(t, tmp_path, how)
    _check_common(cfg, t)
    assert cfg.architecture == "qwen3" and cfg.qk_norm
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (
        t.num_key_value_heads, t.head_dim, t.intermediate_size)
    assert cfg.norm_eps == t.rms_norm_eps and cfg.qkv_bias == cfg.o_bias == t.attention_bias


@pytest.mark.parametrize("how", ["dict", "file"])
@pytest.mark.parametrize("sparse_step, mlp_only", [(1, []), (2, [3]), (3, [0, 2])])
def test_qwen3_moe_round_trip_and_moe_layers(tmp_path, how, sparse_step, mlp_only):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

    t = transformers.Qwen3MoeConfig(**SMALL, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                    num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                                    norm_topk_prob=True, decoder_sparse_step=sparse_step, mlp_only_layers=mlp_only)
    cfg = _round_trip(t, tmp_path, how)
    _check_common(cfg, t)
    assert cfg.architecture == "qwen3_moe" and cfg.qk_norm
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.intermediate_size) == (
        t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size)
    assert cfg.moe.norm_topk_prob == t.norm_topk_prob and cfg.head_dim == t.head_dim
    # Which layers transformers itself builds with a sparse block.
    for i in range(t.num_hidden_layers):
        layer = Qwen3MoeDecoderLayer(t, i)
        assert cfg.is_moe_layer(i) == isinstance(layer.mlp, Qwen3MoeSparseMoeBlock), i


FALCONS = {
    "40b": dict(new_decoder_architecture=True, num_kv_heads=2),
    "7b": dict(new_decoder_architecture=False, multi_query=True),
    "rw": dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False),
}


@pytest.mark.parametrize("how", ["dict", "file"])
@pytest.mark.parametrize("layout", list(FALCONS))
def test_falcon_round_trip(tmp_path, how, layout):
    from transformers.models.falcon.modeling_falcon import FalconAttention, FalconDecoderLayer

    t = transformers.FalconConfig(**SMALL, bias=layout == "rw", ffn_hidden_size=80, **FALCONS[layout])
    cfg = _round_trip(t, tmp_path, how)
    _check_common(cfg, t)
    assert cfg.architecture == "falcon" and isinstance(cfg.arch, FalconLayout) and cfg.norm_eps == t.layer_norm_epsilon
    assert cfg.head_dim == t.head_dim and cfg.intermediate_size == t.ffn_hidden_size
    assert cfg.activation == t.activation and cfg.qkv_bias == cfg.o_bias == cfg.mlp_bias == t.bias
    assert cfg.arch.new_decoder_architecture == t.new_decoder_architecture
    # Structure as transformers' own modules build it.
    t._attn_implementation = "eager"
    assert cfg.num_kv_heads == FalconAttention(t).num_kv_heads
    layer = FalconDecoderLayer(t)
    assert cfg.arch.parallel_attn == (not hasattr(layer, "post_attention_layernorm"))
    assert (cfg.arch.num_ln_in_parallel_attn == 2) == hasattr(layer, "ln_mlp")


_TEXT = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96)
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
# Only the sizes a model cannot do without; the vision tower's left out whole (its defaults' output
# width is 3584, so the text model has that width there).
_GIVEN = {
    "llama": _TEXT, "mistral": _TEXT, "qwen2": _TEXT, "qwen3": _TEXT, "qwen3_moe": {**_TEXT, **_EXPERTS},
    "falcon": dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
    "gemma3_text": {**_TEXT, "num_hidden_layers": 7},  # past one sliding_window_pattern (6)
    "qwen3_vl": dict(text_config={**_TEXT, "hidden_size": 3584}, vision_config={}),
    "qwen3_vl_moe": dict(text_config={**_TEXT, **_EXPERTS, "hidden_size": 3584}, vision_config={}),
}


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_left_out_keys_mean_what_transformers_fills_in(model_type):
    """A config.json holding only a model's sizes parses as the whole file transformers' config class
    writes from it: every key left out (head_dim, positions, rope theta and M-RoPE bands, sliding
    window, special tokens, the vision tower and its DeepStack levels, ...) means the class's
    default. Every supported model_type is here (a new one fails until it has sizes above)."""
    given = {"model_type": model_type, **json.loads(json.dumps(_GIVEN[model_type]))}
    full = transformers.CONFIG_MAPPING[model_type](**_GIVEN[model_type])
    assert parse_hf_config(given) == parse_hf_config(json.loads(full.to_json_string(use_diff=False)))


def test_qwen3_vl_moe_always_renormalises_its_router():
    """transformers' Qwen3-VL-MoE router renormalises its top-k weights whatever the file says (its
    config class has no norm_topk_prob); Qwen3-MoE's follows the key, absent meaning no."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextTopKRouter

    vl = dict(model_type="qwen3_vl_moe", text_config={**_TEXT, **_EXPERTS}, vision_config=dict(out_hidden_size=64))
    for value in (None, False, True):
        text = vl["text_config"] if value is None else {**vl["text_config"], "norm_topk_prob": value}
        assert parse_hf_config({**vl, "text_config": text}).moe.norm_topk_prob
    router = Qwen3VLMoeTextTopKRouter(transformers.Qwen3VLMoeTextConfig(**_TEXT, **_EXPERTS, norm_topk_prob=False))
    torch.nn.init.normal_(router.weight)
    _, weights, _ = router(torch.randn(5, _TEXT["hidden_size"]))
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    assert not parse_hf_config({"model_type": "qwen3_moe", **_TEXT, **_EXPERTS}).moe.norm_topk_prob


def test_transformers5_rope_parameters_and_classic_keys_agree():
    base = dict(model_type="llama", vocab_size=10, hidden_size=32, num_hidden_layers=1,
                num_attention_heads=4, intermediate_size=8, max_position_embeddings=4096)
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=1024)
    classic = parse_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}})
    new = parse_hf_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert classic == new and new.rope.type == "llama3" and new.rope.theta == 5e5


def test_eos_list_and_partial_rotary():
    cfg = parse_hf_config(dict(model_type="llama", vocab_size=10, hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=8, eos_token_id=[3, 4],
                                   partial_rotary_factor=0.25))
    assert cfg.eos_token_ids == (3, 4) and cfg.head_dim == 16 and cfg.rotary_dim == 4


GOOD = dict(model_type="llama", vocab_size=10, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=8)


@pytest.mark.parametrize("changes, words", [
    (dict(model_type="gpt2"), ["model_type", "'gpt2'"]),
    (dict(model_type=None), ["model_type", "None"]),
    (dict(hidden_size=30), ["hidden_size=30", "num_attention_heads=4"]),
    (dict(num_key_value_heads=3), ["num_kv_heads", "3", "num_heads=4"]),
    (dict(vocab_size=None), ["vocab_size", "required"]),
    (dict(num_hidden_layers=0), ["num_layers", "0"]),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), ["type", "'dynamic'"]),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 2.0}), ["low_freq_factor", "required"]),
    (dict(partial_rotary_factor=1.5), ["partial_rotary_factor", "1.5"]),
    (dict(eos_token_id="x"), ["eos_token_id", "'x'"]),
    (dict(torch_dtype="int8"), ["torch_dtype", "'int8'"]),
    (dict(model_type="falcon", alibi=True), ["alibi"]),
    (dict(model_type="qwen3", use_sliding_window=True), ["use_sliding_window"]),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1),
     ["use_sliding_window=True", "layers [1]", "sliding_window=64", "max_window_layers=1"]),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=64, layer_types=["sliding_attention",
                                                                                     "full_attention"]),
     ["layers [0]"]),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8),
     ["num_experts_per_tok", "5", "num_experts=4"]),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
          mlp_only_layers=[2]), ["mlp_only_layers", "[2]"]),
    (dict(model_type="qwen3_vl_moe"), ["text_config"]),
])
def test_bad_configs_name_the_field(changes, words):
    with pytest.raises(ValueError) as err:
        parse_hf_config({**GOOD, **changes})
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_qwen2_window_on_no_layer_is_full_attention():
    """transformers' Qwen2 slides only from max_window_layers on: with all layers below, none does."""
    cfg = parse_hf_config({**GOOD, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
                           "max_window_layers": GOOD["num_hidden_layers"]})
    assert cfg.architecture == "qwen2" and cfg.sliding_window is None


def test_from_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        parse_config_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_config_file(tmp_path)


def test_is_moe_layer_rejects_out_of_range():
    cfg = parse_hf_config(GOOD)
    with pytest.raises(ValueError, match="layer"):
        cfg.is_moe_layer(cfg.num_layers)
    assert not cfg.is_moe_layer(0)


def test_direct_construction_validates():
    cfg = parse_hf_config(GOOD)
    with pytest.raises(ValueError, match=r"ModelConfig.norm_eps: expected a positive number, got 0"):
        cfg.replace(norm_eps=0)
    with pytest.raises(ValueError, match=r"ModelConfig.architecture: expected one of \[.*'llama'.*\], got 'gpt2'"):
        architectures.of(cfg.replace(architecture="gpt2"))
    with pytest.raises(ValueError, match=r"ModelConfig.arch: expected a FalconLayout for architecture 'falcon', "
                                         r"got None"):
        architectures.of(cfg.replace(architecture="falcon"))
    with pytest.raises(ValueError, match=r"ModelConfig.arch: architecture 'llama' has no fields of its own"):
        architectures.of(cfg.replace(arch=FalconLayout()))

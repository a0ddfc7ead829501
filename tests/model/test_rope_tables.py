"""Rotary tables against transformers' own rope code.

For every rope type the inverse frequencies and cos/sin scale are held to
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``, the whole table to
the models' RotaryEmbedding modules, and stagewise.ops.rope with the table to
transformers' apply_rotary_pos_emb on random q/k.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import stagewise.ops as ops
from helpers.kernels import assert_close
from stagewise.model.hf_config import parse_config_file, parse_hf_config
from stagewise.model.layers.rotary import cos_sin_cache, rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

# Both sides compute in float32 with the same operations, so only the last ulp may differ.
TIGHT = dict(rtol=1e-6, atol=1e-6)
MAX_POSITION = 5000  # past original_max_position_embeddings and max_position_embeddings below

ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=256),
    "yarn": dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=512),
    "yarn_mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=128,
                        mscale=1.0, mscale_all_dim=0.707, beta_fast=16.0, beta_slow=2.0),
    "yarn_no_truncate": dict(rope_type="yarn", rope_theta=1e6, factor=2.0, original_max_position_embeddings=512,
                             truncate=False, attention_factor=1.25),
    # Linear with factor 1 is the default frequencies over a partial rotary_dim (transformers'
    # default rope ignores partial_rotary_factor, the scaled types honour it).
    "partial": dict(rope_type="linear", rope_theta=10000.0, factor=1.0, partial_rotary_factor=0.5),
    "partial_yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=256,
                         partial_rotary_factor=0.25),
}


def _llama(rope: dict, head_dim: int = 64) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=16, hidden_size=4 * head_dim, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                                    max_position_embeddings=2048, rope_parameters=dict(rope))


def _hf_cos_sin(rotary_embedding, positions: torch.Tensor, dtype=torch.float32):
    """transformers' cos, sin ``[T, rotary_dim]`` (both halves) at ``positions [T]``."""
    cos, sin = rotary_embedding(torch.zeros(1, dtype=dtype), positions[None])
    return cos[0], sin[0]


def _split(cache: torch.Tensor):
    half = cache.size(1) // 2
    return cache[:, :half], cache[:, half:]


@pytest.mark.parametrize("name", list(ROPES))
def test_frequencies_match_rope_init_functions(name):
    t = _llama(ROPES[name])
    cfg = parse_hf_config(t.to_dict())
    ours, our_scale = rope_frequencies(cfg.rope, cfg.rotary_dim)
    if t.rope_parameters["rope_type"] == "default":
        theirs, their_scale = modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(t)
    else:
        theirs, their_scale = ROPE_INIT_FUNCTIONS[t.rope_parameters["rope_type"]](t, device="cpu")
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, **TIGHT)
    assert our_scale == pytest.approx(their_scale, rel=1e-12)


@pytest.mark.parametrize("name", list(ROPES))
def test_table_matches_rotary_embedding(name):
    t = _llama(ROPES[name])
    cfg = parse_hf_config(t.to_dict())
    cache = cos_sin_cache(cfg, MAX_POSITION)
    assert cache.shape == (MAX_POSITION, cfg.rotary_dim) and cache.dtype == torch.float32
    cos, sin = _hf_cos_sin(modeling_llama.LlamaRotaryEmbedding(t), torch.arange(MAX_POSITION))
    assert cos.shape[-1] == cfg.rotary_dim
    ours_cos, ours_sin = _split(cache)
    # HF repeats the half table (NeoX layout: pair i is features i and i + rotary_dim/2).
    torch.testing.assert_close(ours_cos.repeat(1, 2), cos, **TIGHT)
    torch.testing.assert_close(ours_sin.repeat(1, 2), sin, **TIGHT)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_table_in_model_dtype_rounds_like_transformers(dtype):
    t = _llama(ROPES["yarn"])
    cache = cos_sin_cache(parse_hf_config(t.to_dict()), 3000, dtype=dtype)
    cos, sin = _hf_cos_sin(modeling_llama.LlamaRotaryEmbedding(t), torch.arange(3000), dtype)
    half = cache.size(1) // 2
    assert cache.dtype == dtype
    assert torch.equal(cache[:, :half], cos[:, :half]) and torch.equal(cache[:, half:], sin[:, :half])


@pytest.mark.parametrize("name", ["default", "llama3", "yarn"])
def test_rope_op_with_table_matches_apply_rotary_pos_emb(name, device):
    t = _llama(ROPES[name], head_dim=128)
    cfg = parse_hf_config(t.to_dict())
    cache = cos_sin_cache(cfg, MAX_POSITION, device=device)
    tokens = 37
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=device)
    q = torch.randn(tokens, cfg.num_heads, cfg.head_dim, device=device)
    k = torch.randn(tokens, cfg.num_kv_heads, cfg.head_dim, device=device)
    cos, sin = _hf_cos_sin(modeling_llama.LlamaRotaryEmbedding(t), positions.cpu())
    q_hf, k_hf = modeling_llama.apply_rotary_pos_emb(q.cpu(), k.cpu(), cos, sin, unsqueeze_dim=1)
    ops.rope(q, k, positions, cache, is_neox=cfg.rope.is_neox)
    assert_close(q.cpu(), q_hf)
    assert_close(k.cpu(), k_hf)


def test_partial_rotary_op_leaves_the_tail(device):
    t = _llama(ROPES["partial_yarn"])
    cfg = parse_hf_config(t.to_dict())
    cache = cos_sin_cache(cfg, MAX_POSITION, device=device)
    positions = torch.randint(0, MAX_POSITION, (9,), device=device)
    q = torch.randn(9, cfg.num_heads, cfg.head_dim, device=device)
    k = torch.randn(9, cfg.num_kv_heads, cfg.head_dim, device=device)
    # How HF models with partial rotary apply it: rotate the leading rotary_dim features only.
    cos, sin = _hf_cos_sin(modeling_llama.LlamaRotaryEmbedding(t), positions.cpu())
    rot = cfg.rotary_dim
    q_rot, k_rot = modeling_llama.apply_rotary_pos_emb(q.cpu()[..., :rot], k.cpu()[..., :rot], cos, sin)
    q_hf, k_hf = torch.cat([q_rot, q.cpu()[..., rot:]], -1), torch.cat([k_rot, k.cpu()[..., rot:]], -1)
    ops.rope(q, k, positions, cache, is_neox=True, rotary_dim=rot)
    assert_close(q.cpu(), q_hf)
    assert_close(k.cpu(), k_hf)


_REPO = Path(__file__).resolve().parents[2]
_CONFIG_DIRS = [_REPO / ".." / "shared" / "configs", _REPO / "shared" / "configs"]
CONFIGS = next((d.resolve() for d in _CONFIG_DIRS if d.is_dir()), None)


@pytest.mark.skipif(CONFIGS is None, reason=f"shared configs not found at any of {_CONFIG_DIRS}")
@pytest.mark.parametrize("name, module", [
    ("qwen3-4b.json", "transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding"),
    ("falcon-40b.json", "transformers.models.falcon.modeling_falcon.FalconRotaryEmbedding"),
])
def test_real_config_table_matches_its_model(tmp_path, name, module):
    shutil.copy(CONFIGS / name, tmp_path / "config.json")
    t = transformers.AutoConfig.from_pretrained(tmp_path)
    module_path, cls_name = module.rsplit(".", 1)
    rotary = getattr(__import__(module_path, fromlist=[cls_name]), cls_name)(t)
    cfg = parse_config_file(tmp_path)
    assert cfg.rope.theta == json.loads((CONFIGS / name).read_text()).get("rope_theta", 10000.0)
    positions = torch.arange(0, cfg.max_position_embeddings, 7)
    cos, sin = _hf_cos_sin(rotary, positions)
    ours_cos, ours_sin = _split(cos_sin_cache(cfg, cfg.max_position_embeddings)[positions])
    torch.testing.assert_close(ours_cos.repeat(1, 2), cos, **TIGHT)
    torch.testing.assert_close(ours_sin.repeat(1, 2), sin, **TIGHT)


def test_bad_max_position():
    cfg = parse_hf_config(_llama(ROPES["default"]).to_dict())
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_position"):
            cos_sin_cache(cfg, bad)

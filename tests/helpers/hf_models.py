"""Tiny random float32 models of every architecture, built by transformers itself (its
``state_dict()`` the weights), each weight moved off its initial value; their prompts."""

from __future__ import annotations

import torch
import transformers

from stagewise.model import ModelConfig
from stagewise.model.hf_config import parse_hf_config

BLOCK_SIZE = 4  # small, so that every prompt spans several blocks
SMALL = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64)
LLAMA3 = dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
# YaRN with a small theta and narrow betas, so that head_dim 16's eight frequencies span all three bands
# (extrapolated, ramp, interpolated) and the default attention factor 0.1 ln(4) + 1 scales cos and sin.
YARN = dict(rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=2.0, beta_slow=0.1)

MODELS = {
    "llama-gqa-llama3": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_key_value_heads=2, intermediate_size=96, rope_parameters=LLAMA3)),
    "llama-mqa-tied-linear": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_key_value_heads=1, intermediate_size=96, tie_word_embeddings=True, attention_bias=True,
        mlp_bias=True, rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0))),
    "llama-default-rope": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_key_value_heads=2, intermediate_size=96, rope_parameters=dict(rope_type="default",
                                                                                   rope_theta=1e4))),
    "llama-yarn": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_key_value_heads=2, intermediate_size=96, rope_parameters=YARN)),
    "llama-yarn-untruncated": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_key_value_heads=4, intermediate_size=96, rope_parameters=dict(YARN, truncate=False))),
    # Qwen2.5's shape: q/k/v biases, tied embeddings, rope theta 1e6.
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SMALL, num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    # A 4-token window, shorter than most prompts and generations: Mistral's sliding mask.
    "mistral-window": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **SMALL, num_key_value_heads=2, intermediate_size=96, sliding_window=4)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **SMALL, num_key_value_heads=2, head_dim=32, intermediate_size=96)),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, num_key_value_heads=2, head_dim=16, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    # Gemma 3: sliding and full layers with their own rope bases (linear scaling on the full ones),
    # a 4-token window, a score scale other than head_dim's.
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **SMALL, num_key_value_heads=2, head_dim=16, intermediate_size=96, sliding_window=4,
        query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                         "full_attention": dict(rope_type="linear", rope_theta=1e4, factor=2.0)})),
    "falcon-7b": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        **SMALL, new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=True,
        ffn_hidden_size=80)),
    "falcon-40b": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        **SMALL, new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=80, tie_word_embeddings=False)),
    "falcon-rw": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        **SMALL, new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True)),
}
PROMPT_LENS = (5, 1, 11, 8)
NEW_TOKENS = 8


def make_model(name: str):
    torch.manual_seed(0)
    hf = MODELS[name]().eval()
    with torch.no_grad():
        # Move every weight (norms at 1, biases at 0 included) off its init value so all of them matter.
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.generation_config.eos_token_id = None  # always generate NEW_TOKENS
    hf.generation_config.pad_token_id = 0
    return hf, parse_hf_config(hf.config.to_dict())


def save_random(factory, folder):
    """A tiny random transformers model from ``factory``, every weight moved off its initial value,
    saved to ``folder`` (``save_pretrained``); returns it."""
    torch.manual_seed(0)
    hf = factory().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(folder)
    return hf


def prompts(cfg: ModelConfig) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]

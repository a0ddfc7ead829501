"""Architectures against transformers: tiny random float32 models built by transformers
itself, their ``state_dict()`` as the weights. Checked: prefill logits, greedy decoding
token for token with the paged KV cache, and a model cut into two and three stages."""

from __future__ import annotations

import pytest
import torch

from stagewise.kv import KVCache, KVCacheManager
from stagewise.model import ModelConfig
from stagewise.model.batch import KVMetadata, StepBatch
from stagewise.model.hf_config import parse_hf_config
from stagewise.model.stage import StageModel

transformers = pytest.importorskip("transformers")

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


def prompts(cfg: ModelConfig) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


class Pipeline:
    """Stages ``[0, cuts[0]), [cuts[0], cuts[1]), ...`` each with its own KV manager and cache."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], cuts: tuple[int, ...] = (),
                 device: str = "cpu") -> None:
        bounds = [0, *cuts, cfg.num_layers]
        self.device = device
        self.stages = [StageModel.from_weights(cfg, a, b, weights, device=device) for a, b in zip(bounds, bounds[1:])]
        self.managers = [KVCacheManager(block_size=BLOCK_SIZE, num_blocks=64, max_blocks_per_seq=8)
                         for _ in self.stages]
        self.caches = [KVCache(s.kv_cache_spec(BLOCK_SIZE, torch.float32), num_blocks=64, device=device)
                       for s in self.stages]

    def step(self, prefills: dict[int, list[int]], decodes: dict[int, tuple[int, int]],
             all_logits: bool = False) -> torch.Tensor:
        """One step: ``prefills {rid: prompt}``, ``decodes {rid: (token, position)}``."""
        ids, lens, ctx, tokens, positions = [], [], [], [], []
        for rid, prompt in prefills.items():
            ids.append(rid), lens.append(len(prompt)), ctx.append(0)
            tokens += prompt
            positions += range(len(prompt))
        for rid, (token, pos) in decodes.items():
            ids.append(rid), lens.append(1), ctx.append(pos)
            tokens.append(token), positions.append(pos)
        batch = StepBatch(request_ids=ids, num_prefills=len(prefills), query_lens=lens, context_lens=ctx,
                          positions=torch.tensor(positions, device=self.device),
                          token_ids=torch.tensor(tokens, device=self.device), all_logits=all_logits)
        for stage, manager, cache in zip(self.stages, self.managers, self.caches):
            for rid, prompt in prefills.items():
                manager.add(rid, len(prompt))
            for rid in decodes:
                manager.append(rid)
            out = stage(batch, cache, KVMetadata.build(batch, manager, self.device))
            if not stage.is_last:
                batch = batch.for_next_stage(out)
        return out.cpu()

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """Request i joins at step i, so steps mix a prefill with the decodes of earlier requests."""
        out: list[list[int]] = [[] for _ in prompts]
        step = 0
        while any(len(o) < n for o in out):
            prefills = {step: prompts[step]} if step < len(prompts) else {}
            decodes = {r: (out[r][-1], len(prompts[r]) + len(out[r]) - 1)
                       for r in range(min(step, len(prompts))) if len(out[r]) < n}
            logits = self.step(prefills, decodes)
            for row, rid in enumerate([*prefills, *decodes]):
                out[rid].append(int(logits[row].argmax()))
            step += 1
        return out


ARCHS = list(MODELS)


@pytest.mark.parametrize("name", ARCHS)
def test_prefill_logits_match_transformers(name, device):
    hf, cfg = make_model(name)
    ps = prompts(cfg)
    logits = Pipeline(cfg, hf.state_dict(), device=device).step(dict(enumerate(ps)), {}, all_logits=True)
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in ps])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_decode_matches_generate(name, device):
    hf, cfg = make_model(name)
    ps = prompts(cfg)
    ours = Pipeline(cfg, hf.state_dict(), device=device).greedy(ps, NEW_TOKENS)
    for p, got in zip(ps, ours):
        expected = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
        assert got == expected, (p, got, expected)


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("cuts", [(1,), (2,), (1, 2)], ids=["2-stages-1-2", "2-stages-2-1", "3-stages"])
def test_stages_equal_one(name, cuts, device):
    hf, cfg = make_model(name)
    ps, weights = prompts(cfg), hf.state_dict()
    one, two = Pipeline(cfg, weights, device=device), Pipeline(cfg, weights, cuts=cuts, device=device)
    for pipe in (one, two):  # prefill, then one decode step of every request
        pipe.logits = [pipe.step(dict(enumerate(ps)), {}, all_logits=True),
                       pipe.step({}, {r: (7 + r, len(p)) for r, p in enumerate(ps)})]
    # Stage 0 sends x + residual; the next layer's norm then rounds exactly as the fused add would.
    for a, b in zip(one.logits, two.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_residual_sent_apart_equals_sent_summed():
    hf, cfg = make_model("qwen3")
    weights, ps = hf.state_dict(), prompts(cfg)[:2]
    stage = StageModel.from_weights(cfg, 1, cfg.num_layers, weights)
    t = sum(len(p) for p in ps)
    x, r = torch.randn(t, cfg.hidden_size), torch.randn(t, cfg.hidden_size)
    x_before, outs = x.clone(), []
    for hidden, residual in ((x, r), (x + r, None)):
        manager = KVCacheManager(block_size=BLOCK_SIZE, num_blocks=16, max_blocks_per_seq=8)
        cache = KVCache(stage.kv_cache_spec(BLOCK_SIZE, torch.float32), num_blocks=16)
        batch = StepBatch(request_ids=[0, 1], num_prefills=2, query_lens=[len(p) for p in ps], context_lens=[0, 0],
                          positions=torch.cat([torch.arange(len(p)) for p in ps]), hidden_states=hidden,
                          residual=residual)
        for rid, p in enumerate(ps):
            manager.add(rid, len(p))
        outs.append(stage(batch, cache, KVMetadata.build(batch, manager, "cpu")))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert torch.equal(x, x_before)  # the caller's tensors are not written


def test_step_batch_rejects_bad_shapes():
    good = dict(request_ids=[0, 1], num_prefills=1, query_lens=[3, 1], context_lens=[0, 5],
                positions=torch.tensor([0, 1, 2, 5]), token_ids=torch.tensor([1, 2, 3, 4]))
    StepBatch(**good)
    StepBatch(**{**good, "context_lens": [7, 5], "last_chunk": [False, True]})  # a chunk of a longer prompt
    bad = ((dict(query_lens=[3, 2]), "query_lens"), (dict(context_lens=[-1, 5]), "context_lens"),
           (dict(last_chunk=[True, False]), "last_chunk"), (dict(last_chunk=[True]), "last_chunk"),
           (dict(positions=torch.arange(3)), "positions"), (dict(num_prefills=3), "num_prefills"),
           (dict(hidden_states=torch.zeros(4, 8)), "token_ids"), (dict(request_ids=[0, 0]), "request_ids"))
    for change, field in bad:
        with pytest.raises(ValueError, match=field):
            StepBatch(**{**good, **change})

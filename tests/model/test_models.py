"""Architectures against transformers: tiny random float32 models built by transformers itself
(tests/helpers/hf_models.py), their ``state_dict()`` as the weights. Checked: prefill logits,
greedy decoding token for token with the paged KV cache, and a model cut into two and three
stages."""

from __future__ import annotations

import pytest
import torch

from stagewise.kv import KVCache, KVCacheManager
from stagewise.model import ModelConfig
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata
from stagewise.model.stage import StageModel

transformers = pytest.importorskip("transformers")

from helpers.hf_models import BLOCK_SIZE, MODELS, NEW_TOKENS, make_model, prompts  # noqa: E402


class Pipeline:
    """Stages ``[0, cuts[0]), [cuts[0], cuts[1]), ...`` each with its own KV manager and cache."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], cuts: tuple[int, ...] = (),
                 device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        bounds = [0, *cuts, cfg.num_layers]
        self.device = device
        self.stages = [StageModel.from_weights(cfg, a, b, weights, dtype=dtype, device=device)
                       for a, b in zip(bounds, bounds[1:])]
        self.managers = [KVCacheManager(block_size=BLOCK_SIZE, num_blocks=64, max_blocks_per_seq=8)
                         for _ in self.stages]
        self.caches = [KVCache(s.kv_cache_spec(BLOCK_SIZE, dtype), num_blocks=64, device=device)
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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ARCHS)
def test_bfloat16_on_the_gpu_is_as_close_as_transformers_own(name):
    """bfloat16 on the GPU, against transformers in float32 on the same GPU: our prefill logits are
    no further from it than transformers' own bfloat16 run of the same weights, within twice its
    error plus one bfloat16 rounding step of a logit of 4 (2**-6)."""
    hf, cfg = make_model(name)
    ps = prompts(cfg)
    hf = hf.to("cuda")
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([p], device="cuda")).logits[0] for p in ps]).float().cpu()
        ours = Pipeline(cfg, hf.state_dict(), device="cuda", dtype=torch.bfloat16).step(
            dict(enumerate(ps)), {}, all_logits=True).float()
        hf = hf.to(torch.bfloat16)
        theirs = torch.cat([hf(torch.tensor([p], device="cuda")).logits[0] for p in ps]).float().cpu()
    ours_err, theirs_err = (ours - want).abs().max().item(), (theirs - want).abs().max().item()
    assert ours_err <= 2 * theirs_err + 2**-6, (ours_err, theirs_err)


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

"""Sliding-window attention against transformers (float32): a prompt prefilled in chunks, each
later chunk attending over the cached tokens its window reaches, gives transformers' logits of the
whole prompt; a windowed layer is refused by context parallel attention and by the C++ layer loop,
each saying why. Greedy decoding with a window is in test_models.py."""

from __future__ import annotations

import pytest
import torch

from stagewise.kv import KVCache, KVCacheManager
from stagewise.model.batch import StepBatch
from stagewise.model.kv_metadata import KVMetadata
from stagewise.model.collectives import StageGroups
from stagewise.model.stage import StageModel

transformers = pytest.importorskip("transformers")

from helpers.groups import NoCollectives  # noqa: E402
from helpers.hf_models import BLOCK_SIZE, make_model  # noqa: E402

WINDOWED = ["mistral-window", "gemma3"]
CHUNKS = [(20,), (6, 7, 7), (1, 3, 16), (9, 1, 1, 9), (4, 4, 4, 4, 4)]


def _chunked_logits(stage: StageModel, prompt: list[int], chunks: tuple[int, ...], device: str) -> torch.Tensor:
    """Every token's logits, the prompt run as one request's chunks, one step each."""
    manager = KVCacheManager(block_size=BLOCK_SIZE, num_blocks=16, max_blocks_per_seq=8)
    cache = KVCache(stage.kv_cache_spec(BLOCK_SIZE, torch.float32), num_blocks=16, device=device)
    out, done = [], 0
    for n in chunks:
        batch = StepBatch(request_ids=[0], num_prefills=1, query_lens=[n], context_lens=[done],
                          positions=torch.arange(done, done + n, device=device),
                          token_ids=torch.tensor(prompt[done:done + n], device=device), all_logits=True)
        manager.add(0, n) if done == 0 else manager.append(0, n)
        out.append(stage(batch, cache, KVMetadata.build(batch, manager, device)).cpu())
        done += n
    return torch.cat(out)


@pytest.mark.parametrize("chunks", CHUNKS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("name", WINDOWED)
def test_chunked_prefill_matches_transformers(name, chunks, device):
    hf, cfg = make_model(name)
    prompt = torch.randint(0, cfg.vocab_size, (sum(chunks),), generator=torch.Generator().manual_seed(2)).tolist()
    stage = StageModel.from_weights(cfg, 0, cfg.num_layers, hf.state_dict(), device=device)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_chunked_logits(stage, prompt, chunks, device), expected, rtol=1e-4, atol=1e-4)


def test_the_window_matters():
    """The model of these tests is not one whose window changes nothing."""
    hf, cfg = make_model("mistral-window")
    prompt = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    full = StageModel.from_weights(cfg.replace(sliding_window=None), 0, cfg.num_layers, hf.state_dict())
    stage = StageModel.from_weights(cfg, 0, cfg.num_layers, hf.state_dict())
    a, b = (_chunked_logits(s, prompt, (20,), "cpu") for s in (full, stage))
    torch.testing.assert_close(a[: cfg.sliding_window], b[: cfg.sliding_window], rtol=1e-5, atol=1e-5)
    assert (a[cfg.sliding_window:] - b[cfg.sliding_window:]).abs().max() > 1e-2


def test_the_cpp_layer_loop_says_it_takes_no_window():
    hf, cfg = make_model("mistral-window")
    stage = StageModel.from_weights(cfg, 0, cfg.num_layers, hf.state_dict())
    assert stage.decode_stack is None
    assert stage.python_loop_reason == ("the C++ layer loop attends over every cached token, and layers [0, 1, 2] "
                                        "have a sliding window")


def test_context_parallel_refuses_a_window():
    hf, cfg = make_model("mistral-window")
    with pytest.raises(ValueError, match=r"Attention: layer 0 has a sliding window of 4 tokens, which context parallel "
                                         r"attention does not apply \(cp_size=2\)"):
        StageModel.from_weights(cfg, 0, 1, hf.state_dict(), groups=StageGroups(pcp=NoCollectives(2)))

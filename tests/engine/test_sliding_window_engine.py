"""The engine on sliding-window models against transformers: Gemma 3 (sliding and full layers) and
Mistral (every layer sliding), float32, greedy, several requests at once, prompts prefilled whole
and in chunks shorter than the window. A sliding-window pool is sized for the engine's rows, far
below the whole sequences' blocks, and between steps each request holds only the blocks its
window reaches there: checked after every step, with the blocks given back counted, and against
what stage 0's budget reserved."""

from __future__ import annotations

import pytest
import torch

from stagewise.engine.engine import Engine
from stagewise.engine.params import SamplingParams
from stagewise.kv import PAD_BLOCK_ID
from stagewise.kv.window import blocks_touched
from stagewise.model.stage import StageModel

transformers = pytest.importorskip("transformers")

from helpers.hf_models import BLOCK_SIZE, make_model  # noqa: E402

PROMPT_LENS = (5, 1, 11, 8, 23)
NEW_TOKENS = 14


def _held(manager, rid) -> int:
    return sum(b != PAD_BLOCK_ID for b in manager.block_ids(rid))


@pytest.mark.parametrize("chunk", [8192, 3], ids=["whole", "chunks-of-3"])
@pytest.mark.parametrize("name", ["gemma3", "mistral-window"])
def test_windowed_layers_keep_only_their_window(name, chunk):
    hf, cfg = make_model(name)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist() for p in prompts]
    stage = StageModel.from_weights(cfg, 0, cfg.num_layers, hf.state_dict())
    engine = Engine.for_model(stage, max_num_seqs=3, block_size=BLOCK_SIZE, max_prefill_tokens=chunk)
    ex, budget = engine.executor, engine.scheduler.budget
    windows = [m.window for m in ex.managers]
    assert cfg.sliding_window in windows and (None in windows) == (name == "gemma3")
    full = -(-engine.max_model_len // BLOCK_SIZE) * 3
    for m in ex.managers:  # the full pool holds every row at full length; a window pool its rows' windows
        assert m.pool.num_blocks == (full if m.window is None else 3 * 2 * blocks_touched(m.window - 1, BLOCK_SIZE))
    for rid, p in enumerate(prompts):
        engine.add_request(rid, p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    got, given_back = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] = (out.token_ids, out.finish_reason)
        for m in ex.managers:
            for rid in m.request_ids():
                n, held = m.num_tokens(rid), _held(m, rid)
                assert held <= budget.reserved(rid)[[p.window for p in budget.pools].index(m.window)]
                if m.window is None:
                    assert held == -(-n // BLOCK_SIZE)
                else:
                    assert held <= blocks_touched(m.window - 1, BLOCK_SIZE), (rid, n, m.block_ids(rid))
                    given_back += -(-n // BLOCK_SIZE) - held
    assert got == {rid: (e, "length") for rid, e in enumerate(expected)}
    assert given_back > 0
    assert all(m.num_used_blocks == 0 for m in ex.managers)
    status = engine.status()
    assert status.free_blocks == status.total_blocks


def test_a_window_pool_serves_sequences_longer_than_itself_and_refuses_what_it_cannot():
    """Mistral with every layer sliding: the window's pool is the one that admits. Two blocks (8
    slots) carry a 16-token sequence to the end, token-exact; a prompt whose prefill needs more
    than the whole pool is refused when it is queued, naming the pool."""
    hf, cfg = make_model("mistral-window")
    stage = StageModel.from_weights(cfg, 0, cfg.num_layers, hf.state_dict())
    engine = Engine.for_model(stage, max_num_seqs=1, block_size=BLOCK_SIZE, max_num_tokens=8)
    [pool] = engine.scheduler.budget.pools
    assert pool.window == cfg.sliding_window and pool.num_blocks == 2
    with pytest.raises(ValueError, match=r"has 9 tokens and needs 3 KV blocks, more than the 2 blocks of the pool "
                                         r"of the 4-token window"):
        engine.add_request(0, list(range(1, 10)), SamplingParams(max_new_tokens=2))
    prompt = [5, 6, 7, 8]
    engine.add_request(1, prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    outs = [o for _ in range(40) if engine.has_unfinished() for o in engine.step()]
    expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                           max_new_tokens=12, do_sample=False)[0, 4:].tolist()
    assert [(o.request_id, o.token_ids, o.finish_reason) for o in outs] == [(1, expected, "length")]

"""The time-per-output-token target (stagewise.engine.pacing): the pacer's arithmetic by hand, and
the engine under it on a simulated clock, where every step costs what a linear model of its rows
and prompt tokens says: with the target every request keeps it and the tokens are those of the
engine without one, which breaks it."""

from __future__ import annotations

import types

import pytest
import torch

import stagewise
from stagewise.engine import engine as engine_module
from stagewise.engine import requests as requests_module
from stagewise.engine.pacing import MIN_CHUNK, UNLIMITED, Budget, TpotPacer, CostLine
from stagewise.engine.params import SamplingParams

transformers = pytest.importorskip("transformers")


def test_line_fits_a_line_and_has_no_slope_without_spread():
    line = CostLine(8)
    assert line.fit() is None
    for x in (1, 2, 5):
        line.add(x, 3.0 + 0.5 * x)
    a, b = line.fit()
    assert a == pytest.approx(3.0) and b == pytest.approx(0.5)
    same = CostLine(8)
    for y in (1.0, 3.0):
        same.add(4, y)
    assert same.fit() == (2.0, 0.0)
    falling = CostLine(8)
    falling.add(1, 5.0), falling.add(2, 3.0)
    assert falling.fit() == (4.0, 0.0)  # a step never gets cheaper with more rows: no slope, the mean
    bent = CostLine(16)  # a fixed cost that the line through the points underrates at small x
    for x, y in ((1, 20.0), (2, 21.0), (100, 150.0), (200, 280.0), (300, 410.0), (400, 540.0)):
        bent.add(x, y)
    a, b = bent.fit()
    a90, b90 = bent.fit(upper=0.9)
    assert b90 == b and a90 > a
    assert all(y <= a90 + b * x + 1e-9 for x, y in bent.points)  # 6 points: the top one is the 90 % one


def timed(pacer: TpotPacer, group: int, rows: int, tokens: int, seconds: float, now: float = 100.0) -> None:
    """A step of ``group`` (9: not the group the budgets below are asked for)."""
    pacer.started(group, rows, tokens, now)
    pacer.ended(group, now + seconds)


def test_budget_by_hand():
    pacer = TpotPacer(0.020)
    assert pacer.budget(0, [(0.0, 1)], rows=1, waiting=1, now=0.0) is None  # nothing timed: no limit
    timed(pacer, 9, rows=1, tokens=0, seconds=0.006)
    timed(pacer, 9, rows=3, tokens=0, seconds=0.010)  # decode: 4 ms + 2 ms a row
    assert pacer.decode_s(2) == pytest.approx(0.008)
    # Decoding requests but no prompt priced yet: a probe chunk, at most one new row.
    assert pacer.budget(0, [(0.0, 1)], rows=1, waiting=3, now=0.0) == Budget(MIN_CHUNK, 1)
    timed(pacer, 9, rows=2, tokens=10, seconds=0.008 + 0.001 + 0.010)
    timed(pacer, 9, rows=2, tokens=30, seconds=0.008 + 0.001 + 0.030)  # prompt: 1 ms + 1 ms a token
    fixed, per_token = pacer._prefill.fit()
    assert fixed == pytest.approx(0.001) and per_token == pytest.approx(0.001)
    # Rows: a decode step of r rows stays within 20 ms up to r = 8; 2 run, so 6 may start.
    # Slack of the tightest request (3 tokens, the first 25 ms ago): 60 - 25 = 35 ms, less the
    # step's decode with 2 + min(6, 1 waiting) rows (10 ms) and the fixed 1 ms: 24 tokens.
    clocks = [(0.075, 3), (0.0, 10)]
    assert pacer.budget(0, clocks, rows=2, waiting=1, now=0.100) == Budget(24, 6)
    # Later than its target (3 tokens 70 ms after the first): nothing new starts.
    assert pacer.budget(0, [(0.030, 3)], rows=2, waiting=1, now=0.100) == Budget(0, 0)
    # Slack for fewer than MIN_CHUNK tokens: none (a few tokens would waste the fixed cost).
    assert pacer.budget(0, [(0.060, 3)], rows=2, waiting=1, now=0.100) == Budget(0, 0)  # 9 tokens
    # Nothing decoding: prompts run at once, within the rows the target allows.
    assert pacer.budget(0, [], rows=2, waiting=9, now=0.100) == Budget(UNLIMITED, 6)
    # The time between a group's steps while requests decode counts as part of each step.
    pacer.ended(0, 1.000)
    pacer.budget(0, [(0.9, 5)], rows=2, waiting=0, now=1.010)
    assert pacer.between_s == pytest.approx(0.2 * 0.010)


def test_a_target_one_row_cannot_keep_still_starts_one_request_at_a_time():
    pacer = TpotPacer(0.005)
    timed(pacer, 9, rows=1, tokens=0, seconds=0.008)
    timed(pacer, 9, rows=2, tokens=0, seconds=0.010)
    assert pacer.budget(0, [], rows=0, waiting=4, now=0.0) == Budget(UNLIMITED, 1)
    assert pacer.budget(0, [], rows=1, waiting=4, now=0.0) == Budget(UNLIMITED, 0)
    assert pacer.budget(0, [(0.0, 1)], rows=1, waiting=4, now=0.0) == Budget(MIN_CHUNK, 0)


def test_one_chunk_length_priced_is_all_cost_per_token():
    """A single chunk length gives no slope: its whole cost counts per token, never as free."""
    pacer = TpotPacer(0.020)
    timed(pacer, 9, rows=1, tokens=0, seconds=0.005)
    timed(pacer, 9, rows=2, tokens=16, seconds=0.005 + 0.001 + 0.032)  # decode(2) unknown slope: 5 ms
    assert pacer._prefill.fit() == (pytest.approx(0.033), 0.0)
    # 100 ms of slack less 5 ms of decode: 95 / (33 / 16) = 46 tokens, not unlimited.
    assert pacer.budget(0, [(0.0, 5)], rows=1, waiting=0, now=0.0) == Budget(46, 1)


def test_a_group_idle_between_budgets_and_a_failed_step_add_no_time_between_steps():
    pacer = TpotPacer(0.020)
    timed(pacer, 0, rows=1, tokens=0, seconds=0.005, now=1.0)  # group 0's step came back at 1.005
    pacer.budget(0, [(0.9, 5)], rows=1, waiting=0, now=1.007)
    assert pacer.between_s == pytest.approx(0.2 * 0.002)
    pacer.budget(0, [(0.9, 5)], rows=1, waiting=0, now=3.0)  # asked again, no step since: idle
    assert pacer.between_s == pytest.approx(0.2 * 0.002)
    pacer.started(0, 1, 0, 3.0)
    pacer.ended(0, None)  # failed: nothing priced, no step to count from
    pacer.budget(0, [(0.9, 5)], rows=1, waiting=0, now=5.0)
    assert pacer.between_s == pytest.approx(0.2 * 0.002) and len(pacer._decode.points) == 1


def test_prompts_alone_are_not_priced():
    """A step of prompts with nothing decoding (a long prompt whose attention grows with its
    square) prices nothing: the prompt line is fitted on chunks beside decodes, which it budgets."""
    pacer = TpotPacer(0.020)
    timed(pacer, 9, rows=1, tokens=0, seconds=0.005)
    pacer.started(9, 1, 1000, 100.0, decoding=False)
    pacer.ended(9, 100.9)
    assert pacer._prefill.fit() is None
    timed(pacer, 9, rows=2, tokens=16, seconds=0.005 + 0.016)
    assert pacer._prefill.fit() == (pytest.approx(0.016), 0.0)


@pytest.mark.parametrize("target", [0, -1.0, float("nan"), float("inf"), True, "20"])
def test_bad_targets_are_refused(target):
    with pytest.raises(ValueError, match="target time per output token"):
        TpotPacer(target)


# ---- the engine on a simulated clock ---------------------------------------------------------

TARGET_MS = 14.0


def step_cost_s(batch) -> float:
    """What a step costs on the simulated machine: 4 ms, 1 ms a row, 0.5 ms a prompt token."""
    prompt_tokens = sum(batch.query_lens[: batch.num_prefills])
    return 0.004 + 0.001 * len(batch.request_ids) + 0.0005 * prompt_tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("pacing")
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():  # off their init values, so that greedy tokens are no near-ties
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    return path


def simulate(folder, monkeypatch, tpot_target_ms):
    """Requests arriving every 15 ms with prompts of 8 to 120 tokens; each one's tokens and its
    time per output token on the simulated clock."""
    clock = [0.0]
    fake = types.SimpleNamespace(perf_counter=lambda: clock[0])
    monkeypatch.setattr(engine_module, "time", fake)
    monkeypatch.setattr(requests_module, "time", fake)
    g = torch.Generator().manual_seed(3)
    lengths = [8, 120, 20, 90, 12, 60, 100, 16, 40, 110, 24, 70]
    arrivals = [(0.015 * i, torch.randint(3, 96, (n,), generator=g).tolist(), 12 + (i * 7) % 20)
                for i, n in enumerate(lengths)]
    with stagewise.Pipeline(str(folder), max_num_seqs=8, tpot_target_ms=tpot_target_ms) as pipe:
        engine = pipe._backend.engine
        run = engine.executor.run

        def costed(batch, sampling):
            clock[0] += step_cost_s(batch)
            return run(batch, sampling)

        monkeypatch.setattr(engine.executor, "run", costed)
        record = engine.requests.record
        times: dict[int, list[float]] = {}

        def timed_record(seqs, tokens, logprobs=None, counts=None):
            seqs = list(seqs)
            for seq in seqs:
                times.setdefault(seq.request_id, []).append(clock[0])
            return record(seqs, tokens, logprobs, counts)

        monkeypatch.setattr(engine.requests, "record", timed_record)
        done, pending = {}, list(enumerate(arrivals))
        while pending or engine.has_unfinished():
            while pending and pending[0][1][0] <= clock[0]:
                i, (_, prompt, n) = pending.pop(0)
                engine.add_request(i, prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
            if not engine.has_unfinished():
                clock[0] = pending[0][1][0]
                continue
            for out in engine.step():
                done[out.request_id] = out
    assert sorted(done) == list(range(len(arrivals)))
    # Each token's time since the request's first, over its index: the mean TPOT so far.
    so_far = {i: max((t[k] - t[0]) / k for k in range(1, len(t))) for i, t in times.items()}
    return {i: o.token_ids for i, o in done.items()}, so_far


def test_every_request_keeps_the_target_and_its_tokens(folder, monkeypatch):
    free_tokens, free_tpot = simulate(folder, monkeypatch, None)
    paced_tokens, paced_tpot = simulate(folder, monkeypatch, TARGET_MS)
    assert paced_tokens == free_tokens  # pacing moves prompt chunks between steps, never a token
    assert max(free_tpot.values()) > 1.5 * TARGET_MS / 1e3  # without the target, prompts break it
    # With it, no request's mean time per token passes the target at any of its tokens.
    assert max(paced_tpot.values()) <= TARGET_MS / 1e3 * 1.02, paced_tpot


def test_pipeline_refuses_a_bad_target(folder):
    for bad in (0, float("inf")):
        with pytest.raises(ValueError, match="tpot_target_ms must be a finite number of milliseconds > 0"):
            stagewise.Pipeline(str(folder), tpot_target_ms=bad)

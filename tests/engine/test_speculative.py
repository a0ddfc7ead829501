"""Speculative decoding in one process and across two in-process stages: the n-gram drafter, the
adaptive draft length, the last stage's acceptance (greedy tokens as without drafts; sampled
tokens distributed as the target's, by a chi-square test) and the KV every stage keeps."""

from __future__ import annotations

import pytest
import torch

from helpers.hf_models import BLOCK_SIZE, make_model
from stagewise.engine.engine import Engine
from stagewise.engine.executor import Executor
from stagewise.engine.params import SamplingParams
from stagewise.engine.sampling import History, Sampler
from stagewise.engine.speculative import AdaptiveK, NgramDrafter, SpeculativeConfig
from stagewise.parallel.plan_options import speculative_problems as option_problems
from stagewise.engine.verify import verify
from stagewise.model.stage import StageModel

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.fixture
def free_drafts(monkeypatch):
    """Drafts taken as free: stage 0's cost rule weighs them by this machine's step timings, which
    no two runs repeat, so the tests that count accepted and rejected drafts leave it out
    (test_a_draft_is_made_only_while_its_chance_pays_for_the_time_it_adds holds the rule)."""
    from stagewise.engine.speculative import Speculation

    monkeypatch.setattr(Speculation, "token_share", lambda self, rows: 0.0)


def test_ngram_drafter_proposes_what_followed_the_longest_latest_match():
    d = NgramDrafter(2, 3)
    # (1, 2, 3) occurred once, followed by 4 8 2; the shorter (2, 3) later, followed by 6: the longest wins.
    assert d.lookup("a", [1, 2, 3, 4, 8, 2, 3, 6, 1, 2, 3], 3) == (4, 8, 2)
    # Only (2, 3) matches: its latest occurrence, and no more tokens than there are.
    assert d.lookup("b", [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 2, 3], 3) == (5, 7, 2)
    assert d.lookup("c", [5, 2, 3, 9], 4) == ()  # (3, 9) never occurred before
    tokens = [5, 6, 7, 1, 5, 6]
    assert d.lookup("d", tokens, 2) == (7, 1)
    tokens += [7, 1, 5]  # the index grows with the tokens added since
    assert d.lookup("d", tokens, 2) == (6, 7)
    tokens += [9, 9, 9]
    assert d.lookup("d", tokens, 3) == (9,)  # (9, 9) ended at the last token but one: 9 followed it
    d.forget("d")
    assert d.lookup("d", [1, 2], 3) == () and d.lookup("d", [1, 2, 1, 2], 0) == ()


def test_adaptive_k_stops_drafting_while_drafts_are_rejected_and_probes_again():
    k = AdaptiveK(4)
    assert k.next_k("r") == 4
    seen = []
    for _ in range(30):
        n = k.next_k("r")
        seen.append(n)
        k.verified("r", n, 0)
    assert seen[:1] == [4] and 0 in seen and max(seen[5:]) == 1  # down to none, then one-token probes
    gaps = [j - i for i, j in zip([i for i, n in enumerate(seen) if n], [i for i, n in enumerate(seen) if n][1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # probes ever further apart
    for _ in range(40):
        n = k.next_k("r")
        k.verified("r", n, n)
    assert k.next_k("r") == 4  # predictable again: the full length


def test_options_are_checked():
    assert option_problems("ngram", 3) == [] and option_problems(None, 1) == []
    assert option_problems("draft:/models/small.gguf", 2) == []
    assert "speculative must be ngram or draft:PATH" in option_problems("eagle", 3)[0]
    assert option_problems("draft:", 3) and SpeculativeConfig.of("draft:a:b").draft_model == "a:b"
    assert "num_speculative_tokens must be an int >= 1" in option_problems("ngram", 0)[0]
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig(ngram_min=5, ngram_max=2)


def _reference_greedy(logits, drafts, params, history):
    """One row at a time through the sampler, the accepted drafts counted as output."""
    out, hist = [], History(history.prompt, list(history.output.elements()))
    for j in range(len(drafts) + 1):
        token = int(Sampler().sample(logits[j:j + 1], [params], [None], [hist])[0])
        out.append(token)
        if j == len(drafts) or token != drafts[j]:
            return out
        hist.append(token)


@pytest.mark.parametrize("penalty", [{}, {"repetition_penalty": 1.8, "frequency_penalty": 0.9}])
def test_greedy_verification_accepts_exactly_what_greedy_decoding_picks(penalty):
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.0, **penalty)
    accepted = 0
    for trial in range(60):
        logits = torch.randn(5, 12, generator=g) * 2
        history = History([1, 2, 3], [4, 4, 5])
        ref_full = _reference_greedy(logits, [-1] * 4, params, history)[:1]
        # Drafts that follow greedy decoding for a while, then guess.
        drafts = []
        for j in range(4):
            pick = _reference_greedy(logits, drafts + [-1], params, history)[j] if trial % 3 else int(
                torch.randint(0, 12, (1,), generator=g))
            drafts.append(pick)
        got = verify(logits, [drafts], [params], [None], [history if penalty else None]).tokens[0]
        assert got == _reference_greedy(logits, drafts, params, history)
        assert got[0] == ref_full[0]
        accepted += len(got) - 1
    assert accepted > 60  # the test saw accepted drafts, not only rejections


def test_sampled_verification_draws_the_target_distribution():
    """Chi-square against the sampler's own distribution at the first position, and at the second
    given the first draft was accepted. Each check has a false-alarm rate of 1e-4 (on a fair rule);
    a rule that accepts drafts too often or draws the wrong residual fails both by far."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 6, 6000
    logits = torch.randn(3, vocab, generator=g)
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.95, seed=11)
    drafts = [int(logits[0].argsort()[-2]), int(logits[1].argmax())]  # a likely but not the likeliest token
    probs = Sampler.filtered_probs(logits, [params] * 3)
    gen = torch.Generator().manual_seed(11)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(n):
        tokens = verify(logits, [drafts], [params], [gen], [None]).tokens[0]
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            second[tokens[1]] += 1
    for counts, p in ((first, probs[0]), (second, probs[1])):
        support = p > 0
        assert counts[~support].sum() == 0  # never a token the filters removed
        expected = p[support] / p[support].sum() * counts.sum()
        assert scipy_stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-4


def _stage(cfg, sd, start, end):
    model = StageModel.from_weights(cfg, start, end, sd)
    return Executor(model, num_blocks=96, block_size=BLOCK_SIZE, max_model_len=cfg.max_position_embeddings)


def _prompts(cfg):
    g = torch.Generator().manual_seed(1)
    base = torch.randint(3, cfg.vocab_size, (6,), generator=g).tolist()
    return [base * 3, base[:3] * 4 + [7], torch.randint(3, cfg.vocab_size, (5,), generator=g).tolist()]


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(i, p, params)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    return [outs[i] for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["llama-gqa-llama3", "qwen3", "qwen3-moe"])
def test_greedy_tokens_equal_decoding_without_drafts(name, free_drafts):
    hf, cfg = make_model(name)
    sd = hf.state_dict()
    prompts = _prompts(cfg)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1)
    plain = _run(Engine(_stage(cfg, sd, 0, cfg.num_layers), max_num_seqs=4), prompts, params)
    for k in (1, 3, 5):
        engine = Engine(_stage(cfg, sd, 0, cfg.num_layers), max_num_seqs=4, speculative=SpeculativeConfig(num_tokens=k))
        got = _run(engine, prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in plain]
        for a, b in zip(got, plain):
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        st = engine.speculation.stats
        assert st.accepted > 0 and st.proposed > st.accepted  # drafts were accepted and rejected
        assert sum(o.draft_tokens for o in got) == st.proposed and sum(o.accepted_tokens for o in got) == st.accepted
        assert engine.executor.manager.num_used_blocks == 0 and engine.scheduler.budget.num_free_blocks == 96


def test_max_tokens_and_stop_tokens_are_never_overshot():
    hf, cfg = make_model("llama-gqa-llama3")
    sd = hf.state_dict()
    prompts = _prompts(cfg)
    for extra in ({"max_new_tokens": 7}, {"max_new_tokens": 30, "stop_token_ids": [0]}):
        params = SamplingParams(temperature=0.0, ignore_eos=True, **extra)
        plain = _run(Engine(_stage(cfg, sd, 0, cfg.num_layers), max_num_seqs=4), prompts, params)
        spec = _run(Engine(_stage(cfg, sd, 0, cfg.num_layers), max_num_seqs=4,
                           speculative=SpeculativeConfig(num_tokens=5)), prompts, params)
        assert [(o.token_ids, o.finish_reason) for o in spec] == [(o.token_ids, o.finish_reason) for o in plain]


def test_every_stage_rolls_back_rejected_drafts_and_keeps_the_accepted_kv(free_drafts):
    """Stage 0 (layers 0-1) and the last stage (1-3) as two executors: after every step both hold
    the same number of each request's tokens, and their KV of the accepted positions equals that
    of a run without drafts (the rejected drafts' KV was dropped, not kept)."""
    hf, cfg = make_model("llama-gqa-llama3")
    sd = hf.state_dict()
    prompts = _prompts(cfg)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)

    def two_stages(spec):
        engine = Engine(_stage(cfg, sd, 0, 1), max_num_seqs=4, speculative=spec)
        last = _stage(cfg, sd, 1, cfg.num_layers)
        for i, prompt in enumerate(prompts):
            engine.add_request(i, prompt, params)
        return engine, last

    def step(engine, last):
        launched, _ = engine.launch(0)
        out = last.run(launched.batch.for_next_stage(launched.output), launched.sampling)
        engine.complete(0, launched.step_id, launched.batch.sampled_ids(), out.tokens.tolist(), out.logprobs,
                        out.counts)
        for rid in range(len(prompts)):
            assert engine.executor.manager.num_tokens(rid) == last.manager.num_tokens(rid)
        return engine.scheduler.groups[0].running

    spec, spec_last = two_stages(SpeculativeConfig(num_tokens=4))
    seqs = step(spec, spec_last)  # the prompts
    rolled_back = 0
    while all(len(s.output_ids) < 30 for s in seqs.values()):  # a step adds 5 at most: none ends
        rolled_back += sum(spec_last.manager.num_tokens(r) > s.num_cached for r, s in seqs.items())
        step(spec, spec_last)  # drops the rejected positions on both stages before it writes
    assert rolled_back > 0
    st = spec.speculation.stats
    assert st.accepted > 0 and st.proposed > st.accepted  # drafts were accepted and rejected
    plain, plain_last = two_stages(None)
    ref = step(plain, plain_last)
    while any(len(ref[r].output_ids) < len(s.output_ids) for r, s in seqs.items()):
        step(plain, plain_last)
    for rid, seq in seqs.items():
        n = seq.num_cached
        assert ref[rid].output_ids[:len(seq.output_ids)] == seq.output_ids
        for a, b in ((spec.executor, plain.executor), (spec_last, plain_last)):
            ka, kb = a.export_request(rid), b.export_request(rid)
            torch.testing.assert_close(ka.k[:, :n], kb.k[:, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ka.v[:, :n], kb.v[:, :n], atol=1e-5, rtol=1e-5)


def test_a_stage_refuses_a_rollback_its_last_step_did_not_draft():
    hf, cfg = make_model("llama-gqa-llama3")
    engine = Engine(_stage(cfg, hf.state_dict(), 0, cfg.num_layers), max_num_seqs=2)
    engine.add_request(0, [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=5, temperature=0.0))
    engine.step()
    engine.step()
    seq = engine.scheduler.groups[0].running[0]
    seq.output_ids.pop()  # stage 0 now asks for a position the stage holds less than: no drafts explain it
    engine.scheduler.budget.truncate(0, seq.num_cached)
    [out] = engine.step()
    assert out.finish_reason == "error" and "holds" in out.error


def test_sliding_window_models_refuse_speculation():
    hf, cfg = make_model("mistral-window")
    with pytest.raises(ValueError, match="sliding-window"):
        Engine(_stage(cfg, hf.state_dict(), 0, cfg.num_layers), speculative=SpeculativeConfig())


def test_drafts_beside_a_tpot_target_and_chunked_prompts_keep_the_tokens(free_drafts):
    """With a TPOT target (the pacer counts each draft as a decode row) and prompts prefilled in
    chunks of 4 beside the verifying rows: the tokens of decoding without drafts."""
    hf, cfg = make_model("qwen3")
    sd = hf.state_dict()
    prompts = _prompts(cfg)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    plain = _run(Engine(_stage(cfg, sd, 0, cfg.num_layers), max_num_seqs=4), prompts, params)
    engine = Engine(_stage(cfg, sd, 0, cfg.num_layers), max_num_seqs=4, max_prefill_tokens=4, tpot_target_s=0.05,
                    speculative=SpeculativeConfig(num_tokens=3))
    got = _run(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain] and engine.speculation.stats.accepted > 0


def test_a_request_may_cap_its_drafts_or_take_none():
    hf, cfg = make_model("llama-gqa-llama3")
    sd = hf.state_dict()
    prompts = _prompts(cfg)
    engine = Engine(_stage(cfg, sd, 0, cfg.num_layers), max_num_seqs=4, speculative=SpeculativeConfig(num_tokens=5))
    plain = _run(Engine(_stage(cfg, sd, 0, cfg.num_layers), max_num_seqs=4), prompts,
                 SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    for cap in (0, 1):
        got = _run(engine, prompts, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True,
                                                   max_draft_tokens=cap))
        assert [o.token_ids for o in got] == [o.token_ids for o in plain]
        steps = sum(len(o.token_ids) - 1 - o.accepted_tokens for o in got)  # decode steps
        assert sum(o.draft_tokens for o in got) <= cap * steps and (cap == 0) == (sum(o.draft_tokens for o in got) == 0)


def test_a_tight_pool_never_fails_a_step_for_drafts():
    """Pools too small for every request: the scheduler may end a request for want of blocks, as
    without drafts, but a rejected draft's blocks count as held until every stage dropped them (the
    request's next step, before it takes any), and drafts take only what every decode slot left: no
    step fails inside a stage for blocks the scheduler thought free."""
    hf, cfg = make_model("llama-gqa-llama3")
    sd = hf.state_dict()
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    for _ in range(6):
        base = torch.randint(3, cfg.vocab_size, (4,), generator=g).tolist()
        prompts = [base * 3, base[:3] * 4 + [7], torch.randint(3, cfg.vocab_size, (5,), generator=g).tolist(),
                   base * 2 + [9], base[1:] * 3]
        for blocks in (10, 12, 14, 16):
            model = StageModel.from_weights(cfg, 0, cfg.num_layers, sd)
            engine = Engine(Executor(model, num_blocks=blocks, block_size=BLOCK_SIZE,
                                     max_model_len=cfg.max_position_embeddings),
                            max_num_seqs=4, speculative=SpeculativeConfig(num_tokens=4), prefix_cache=False)
            outs = _run(engine, prompts, params)
            assert not [o.error for o in outs if o.error and "step failed" in o.error]


def test_a_draft_model_that_cannot_draft_leaves_the_steps_without_drafts(tmp_path, caplog):
    """Its own KV pool full: the step runs without drafts (said once in the log per step), the
    tokens are those without drafts, and the draft catches up when it has room again."""
    from helpers.hf_models import MODELS, save_random
    from stagewise.engine.draft_model import DraftModel

    hf = save_random(MODELS["llama-gqa-llama3"], tmp_path)
    cfg = make_model("llama-gqa-llama3")[1]
    sd = hf.state_dict()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (30,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    plain = _run(Engine(_stage(cfg, sd, 0, cfg.num_layers), max_num_seqs=4), prompts, params)
    spec = SpeculativeConfig(method="draft", draft_model=str(tmp_path), num_tokens=3)
    engine = Engine(_stage(cfg, sd, 0, cfg.num_layers), max_num_seqs=4, speculative=spec)
    draft = engine.speculation.drafter
    assert isinstance(draft, DraftModel)
    draft.executor = Executor(draft.executor.model, num_blocks=8, block_size=16, max_model_len=64)  # 2 requests
    got = _run(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert "could not draft" in caplog.text and not draft.executor.requests


def test_a_draft_is_made_only_while_its_chance_pays_for_the_time_it_adds():
    """The j-th draft is accepted with a chance of about rate ** j; a step's tokens decide a share of
    its time (fitted on stage 0's decode steps: a + b * tokens). Where tokens are nearly free (batch
    1, reading the weights) drafts go on at a low rate; where they cost (a batch that is compute
    bound) only likely drafts are made, and none when even the first does not pay."""
    from stagewise.engine.speculative import Speculation

    k = AdaptiveK(4)
    k.verified("r", 4, 2)  # rate 0.57
    assert [k.next_k("r", share) for share in (0.0, 0.3, 0.5)] == [4, 2, 1]
    assert k.next_k("r", 0.7) == 0 and k.next_k("r", 0.0) == 1  # backs off, then probes
    spec = Speculation(SpeculativeConfig(num_tokens=4), NgramDrafter(), max_model_len=64)
    assert spec.token_share(16) == 0.0  # nothing timed yet: drafts are assumed free
    for tokens in (1, 2, 4, 8, 12, 16, 20, 24):
        spec.timed(tokens, 0.004 + 0.001 * tokens)
    assert spec.token_share(1) == pytest.approx(0.2) and spec.token_share(16) == pytest.approx(0.8)

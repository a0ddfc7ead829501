"""The pipeline's serving logic in one process, through its real protocol and frame codec but no
sockets: a Head (stage 0) and Workers (later stages) whose steps overlap as in a pipeline
(several microbatch groups in flight, frames delivered to the stages in a random interleaving)
give exactly the tokens of the single-process Engine — greedy and seeded sampling, with
cancellations in between, prompts prefilled whole or in chunks — and every stage ends with no
request state. Each runs on Qwen3, on Gemma 3 (sliding and full layers) and on Mistral (every
layer sliding), with the sliding-window pools sized for the engine's rows, smaller than the
requests' whole sequences: they hold up only when every stage gives back the blocks that leave
the window."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from stagewise.engine.engine import Engine
from stagewise.engine.executor import Executor
from stagewise.engine.params import SamplingParams
from stagewise.model.stage import load_stage
from stagewise.parallel import StagePlan
from stagewise.pipeline import handoff_frames, protocol
from stagewise.pipeline.messages import Add, Cancel
from stagewise.pipeline.protocol import ProtocolError, Step, StepFailed
from stagewise.pipeline.roles import Head, Route, Worker
from stagewise.transport import decode_frame, encode_frame

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=101, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=128, bos_token_id=1, eos_token_id=None)
BLOCK = 4
NUM_BLOCKS = 96
MAX_LEN = 64


MODELS = {
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=16)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **SMALL, head_dim=16, sliding_window=3, query_pre_attn_scalar=16, layer_types=[
            "sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=5)),
}
MAX_NUM_SEQS = 6


@pytest.fixture(scope="module", params=list(MODELS))
def folder(tmp_path_factory, request):
    torch.manual_seed(0)
    hf = MODELS[request.param]().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path


def executor(folder, start: int, end: int, num_blocks: int = NUM_BLOCKS) -> Executor:
    return Executor(load_stage(folder, start, end, dtype="float32"), num_blocks=num_blocks, block_size=BLOCK,
                    max_model_len=MAX_LEN, max_num_seqs=MAX_NUM_SEQS)


def requests(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 101) for _ in range(rng.randint(1, 13))]
        sampled, penalised = i % 3 == 1, i % 4 == 2
        out.append((prompt, SamplingParams(max_new_tokens=rng.randint(1, 9), temperature=0.8 if sampled else 0.0,
                                           top_k=20 if sampled else 0, min_p=0.05 if sampled else 0.0, seed=100 + i,
                                           ignore_eos=True, repetition_penalty=1.5 if penalised else 1.0,
                                           presence_penalty=0.5 if penalised else 0.0,
                                           logprobs=2 if i % 5 == 3 else None)))
    return out


def shared_prefix_requests(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """:func:`requests` whose prompts begin with one of three prefixes (up to 4 blocks), some of them
    the whole prompt of an earlier request: prefix-cache hits of every length."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 101) for _ in range(k)] for k in (5, 9, 16)]
    out = []
    for i, (prompt, params) in enumerate(requests(n, seed)):
        base = prefixes[i % 3] if i % 4 else prefixes[(i + 1) % 3] + prompt[:3]
        out.append((base + prompt[: rng.randint(0, 5)] if i % 5 else list(base), params))
    return out


def run_engine(folder, reqs, prefix_cache: bool = True, engine: Engine | None = None) -> dict[int, tuple[list[int], str]]:
    engine = engine or Engine(executor(folder, 0, 5), max_num_seqs=MAX_NUM_SEQS, prefix_cache=prefix_cache)
    for rid, (prompt, params) in enumerate(reqs):
        engine.add_request(rid, prompt, params)
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id] = (out.token_ids, out.finish_reason)
    assert all(reason == "length" for _, reason in results.values())  # none ran out of KV blocks
    return results


def make_stages(folder, ranges, **engine_options) -> tuple[Head, list[Worker]]:
    n = len(ranges)
    head = Head(Engine(executor(folder, *ranges[0]), max_num_seqs=MAX_NUM_SEQS, num_groups=n, **engine_options))
    return head, [Worker(executor(folder, a, b), index=i, num_stages=n) for i, (a, b) in enumerate(ranges[1:], 1)]


def pool_state(pool) -> tuple:
    """The order a pool hands blocks out in: its free stack, then its cached blocks (eviction order)."""
    return tuple(pool._free), tuple(pool._cached), tuple(pool._refs)


def wire(frame):
    """A frame as the next process sees it: encoded, checksummed and decoded by the codec."""
    return decode_frame(encode_frame(frame))


def run_pipeline(folder, reqs, ranges, cancel_at: dict[int, int], seed: int, max_prefill_tokens: int = 8192,
                 tpot_target_s: float | None = None, stages: tuple[Head, list[Worker]] | None = None):
    """Stage i's inbox holds the frames sent to it (0: the feedback link); each round delivers the
    oldest frame of a random non-empty inbox. At the end every stage's block pool must be in the
    same state as stage 0's (prefix caching names block ids that must mean the same everywhere)."""
    n = len(ranges)
    head, workers = stages or make_stages(folder, ranges, max_prefill_tokens=max_prefill_tokens,
                                          tpot_target_s=tpot_target_s)
    inbox = [collections.deque() for _ in range(n)]
    for rid, (prompt, params) in enumerate(reqs):
        head.on_message(Add(request_id=rid, prompt_ids=prompt, params=params))
    rng, results, rounds = random.Random(seed), {}, 0
    while head.busy or any(inbox):
        rounds += 1
        assert rounds < 10_000
        inbox[1] += map(wire, head.launch())
        events = head.take_events()
        for r in events.done if events else []:
            results[r.request_id] = (r.token_ids, r.finish_reason)
        ready = [i for i, q in enumerate(inbox) if q]
        if not ready:
            continue
        pick = rng.choice(ready)
        frame = inbox[pick].popleft()
        if pick == 0:
            inbox[1] += map(wire, head.on_feedback(protocol.from_frame(frame, None)))
            for rid, at in cancel_at.items():
                if at <= rounds and rid not in results:
                    head.on_message(Cancel(request_id=rid))
            continue
        for route, out in workers[pick - 1].handle(frame):
            inbox[0 if route is Route.FEEDBACK else pick + 1].append(wire(out))
    events = head.take_events()
    for r in events.done if events else []:
        results[r.request_id] = (r.token_ids, r.finish_reason)
    # Every stage forgot every request: KV blocks back in the pool, no sampling state left.
    pools = {}
    for ex in [head.engine.executor] + [w.executor for w in workers]:
        assert all(m.num_used_blocks == 0 for m in ex.managers) and not ex.requests
        for m in ex.managers:  # each pool of a window (full attention: None) as stage 0's of that window
            assert pool_state(m.pool) == pools.setdefault(m.window, pool_state(m.pool)), m.window
    status = head.engine.status()
    assert status.free_blocks == status.total_blocks
    return results


@pytest.mark.parametrize("partition", ["even", "0-1,1-4,4-5", "balanced"])
def test_overlapping_microbatches_equal_the_single_process_engine(folder, partition):
    reqs = requests(14, seed=3)
    expected = run_engine(folder, reqs)
    plan = StagePlan.build(5, 3, partition, costs=([1.0] * 5, 0.5, 2.0))
    assert run_pipeline(folder, reqs, plan.ranges, {}, seed=11) == expected


def test_two_and_five_stages_with_cancellations(folder):
    reqs = requests(10, seed=5)
    expected = run_engine(folder, reqs)
    for ranges in ([(0, 2), (2, 5)], [(i, i + 1) for i in range(5)]):
        got = run_pipeline(folder, reqs, ranges, {2: 7, 5: 30}, seed=len(ranges))
        assert_runs_equal(got, expected, len(reqs))
        assert sum(reason == "cancelled" for _, reason in got.values()) >= 1


@pytest.mark.parametrize("target_s", [1e-6, 0.05])
def test_a_tpot_target_across_stages_changes_no_token(folder, target_s):
    """Stage 0 paces new prompts by the time its steps take to come back through 3 stages: with a
    target no step can keep (requests then start one batch after another) and with a loose one,
    every request still ends, with the single-process engine's tokens."""
    reqs = requests(10, seed=9)
    expected = run_engine(folder, reqs)
    got = run_pipeline(folder, reqs, [(0, 1), (1, 4), (4, 5)], {}, seed=7, tpot_target_s=target_s)
    assert_runs_equal(got, expected, len(reqs))


@pytest.mark.parametrize("chunk", [1, 3])
def test_prompts_prefilled_in_chunks_across_stages_equal_the_whole_prompt_engine(folder, chunk):
    """Chunks of 1 and 3 tokens (blocks of 4) beside decodes, over 3 stages with 3 groups in flight:
    steps that sample nothing (only chunks more of their prompts follow) still complete, and a
    request cancelled while its prompt is half prefilled frees its KV on every stage."""
    reqs = requests(10, seed=8)
    expected = run_engine(folder, reqs)
    got = run_pipeline(folder, reqs, [(0, 1), (1, 4), (4, 5)], {4: 5}, seed=chunk, max_prefill_tokens=chunk)
    assert_runs_equal(got, expected, len(reqs))


def assert_runs_equal(got: dict, expected: dict, n: int) -> None:
    """Every request of the pipeline's run as in the engine's; a cancelled one a prefix of it, cut
    where the cancel landed."""
    for rid, (tokens, reason) in got.items():
        if reason == "cancelled":
            assert tokens == expected[rid][0][: len(tokens)]
        else:
            assert (tokens, reason) == expected[rid], rid
    assert sorted(got) == list(range(n))


def test_a_failing_later_stage_ends_only_that_step(folder):
    engine = Engine(executor(folder, 0, 2), max_num_seqs=4, num_groups=2)
    engine.add_request(0, [5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0.0))
    engine.add_request(1, [8, 9], SamplingParams(max_new_tokens=3, temperature=0.0))
    g0, g1 = engine.idle_groups_with_work()
    step0, _ = engine.launch(g0)
    step1, _ = engine.launch(g1)
    done = engine.fail(step0.group, step0.step_id, "stage 1 failed: boom")
    assert [(o.request_id, o.finish_reason, o.error) for o in done] == [(0, "error", "stage 1 failed: boom")]
    assert engine.take_freed() == [0]
    with pytest.raises(ValueError, match="no step 99 in flight for group"):
        engine.complete(step1.group, 99, [1], [3])
    assert engine.complete(step1.group, step1.step_id, [1], [42]) == []
    assert engine.has_unfinished()


def test_each_groups_step_goes_out_before_the_next_group_computes(folder):
    """Stage 1 can start on group 0 while stage 0 computes group 1 (not after both)."""
    head = Head(Engine(executor(folder, 0, 2), max_num_seqs=4, num_groups=2))
    for rid in range(2):
        head.on_message(Add(request_id=rid, prompt_ids=[5, 6, 7 + rid], params=SamplingParams(max_new_tokens=2)))
    frames = head.launch()
    first = next(frames)
    assert first.microbatch == 0 and list(head.engine.inflight) == [0]
    second = next(frames)
    assert second.microbatch == 1 and sorted(head.engine.inflight) == [0, 1]
    assert list(frames) == []


def test_a_worker_rejects_frames_that_do_not_fit_and_reports_failed_steps(folder):
    head = Head(Engine(executor(folder, 0, 2), max_num_seqs=2))
    worker = Worker(executor(folder, 2, 5, num_blocks=1), index=1, num_stages=2)
    head.on_message(Add(request_id=0, prompt_ids=list(range(3, 12)), params=SamplingParams(max_new_tokens=4)))
    [frame] = head.launch()
    step = protocol.from_frame(wire(frame), worker.shape)
    assert isinstance(step, Step) and step.batch.request_ids == (0,)
    bad = wire(frame)
    bad.stage_to = 3
    with pytest.raises(ProtocolError, match="stage_to is 3"):
        worker.handle(bad)
    bad = wire(frame)
    bad.tensors["hidden"] = bad.tensors["hidden"][:, :7]
    with pytest.raises(ProtocolError, match=r"tensors\['hidden'\]: expected shape"):
        worker.handle(bad)
    # A prompt of 9 tokens needs 3 blocks; this stage has 1: the step fails, the stage serves on.
    [(route, out)] = worker.handle(wire(frame))
    failed = protocol.from_frame(wire(out), None)
    assert route is Route.FEEDBACK and isinstance(failed, StepFailed) and "stage 1 step failed" in failed.message
    [free] = head.on_feedback(failed)  # the other stages forget the request
    assert protocol.from_frame(wire(free), None) == protocol.Free(request_ids=[0])
    events = head.take_events()
    assert [(r.request_id, r.finish_reason) for r in events.done] == [(0, "error")]
    assert not worker.executor.requests


def test_kv_handoff_moves_a_request_between_two_stage_instances(folder):
    """Run a request on one instance of the last stage, move its KV (through the wire codec) to
    a second instance, continue there: the tokens are those of the engine, with seeded sampling
    and penalties (their history moves too)."""
    prompt, params = [5, 9, 14, 3, 77, 21], SamplingParams(max_new_tokens=10, temperature=0.7, top_k=30, seed=5,
                                                            ignore_eos=True, repetition_penalty=1.3,
                                                            frequency_penalty=0.4)
    expected = run_engine(folder, [(prompt, params)])[0][0]
    engine = Engine(executor(folder, 0, 2), max_num_seqs=2)
    first, second = executor(folder, 2, 5), executor(folder, 2, 5)
    second.manager.add("someone-else", 7)  # a busy instance: the request lands on other blocks
    engine.add_request(0, prompt, params)
    stage, tokens = first, []
    while engine.has_unfinished():
        step, _ = engine.launch(0)
        out = stage.run(step.batch.for_next_stage(step.output), step.sampling).tokens.tolist()
        tokens += out
        engine.complete(0, step.step_id, [0], out)
        if len(tokens) == 4:  # move mid-generation
            frame = wire(handoff_frames.handoff_frame(first.export_request(0), stage=1))
            first.free([0])
            second.import_request(handoff_frames.handoff_from_frame(frame))
            stage = second
    assert tokens == expected
    with pytest.raises(ValueError, match="holds layers"):
        executor(folder, 1, 5, num_blocks=8).import_request(handoff_frames.handoff_from_frame(frame))
    with pytest.raises(ProtocolError, match="expected a KV_HANDOFF frame"):
        handoff_frames.handoff_from_frame(wire(protocol.to_frame(protocol.Free(request_ids=[1]), stage_from=0, stage_to=1)))


# ---- prefix caching ----------------------------------------------------------------------------

def test_shared_prefixes_are_computed_once_and_change_no_token(folder):
    """Prompts that begin with the same blocks (some the whole prompt of an earlier request), in
    one process and over 2 and 3 stages with cancellations, chunks of 3 tokens (hits in the middle
    of chunked prompts) and a TPOT target: every token is the uncached engine's, and later requests
    start after cached blocks (a model with a sliding window caches nothing)."""
    reqs = shared_prefix_requests(18, seed=12)
    expected = run_engine(folder, reqs, prefix_cache=False)
    engine = Engine(executor(folder, 0, 5), max_num_seqs=MAX_NUM_SEQS)
    assert run_engine(folder, reqs, engine=engine) == expected
    windowed = engine.prefix is None
    assert windowed or engine.prefix.stats.hit_tokens >= 8 * BLOCK
    for ranges, options, cancel in (([(0, 2), (2, 5)], {}, {3: 9}),
                                    ([(0, 1), (1, 4), (4, 5)], dict(max_prefill_tokens=3), {5: 12}),
                                    ([(0, 3), (3, 4), (4, 5)], dict(tpot_target_s=1e-6), {})):
        head, workers = make_stages(folder, ranges, **options)
        got = run_pipeline(folder, reqs, ranges, cancel, seed=len(ranges), stages=(head, workers))
        assert_runs_equal(got, expected, len(reqs))
        assert windowed or head.engine.prefix.stats.hit_tokens >= 4 * BLOCK


def test_no_step_writes_into_a_block_that_another_request_holds(folder):
    """Every slot a step writes lies in a block that only the writing request holds: a shared
    (cached) block is never written, on any stage, while others read it."""
    ranges = [(0, 2), (2, 5)]
    head, workers = make_stages(folder, ranges, max_prefill_tokens=5)
    written = []
    for ex in [head.engine.executor] + [w.executor for w in workers]:
        for meta in ex._metadata:
            def build(batch, pcp=None, build=meta.build, manager=meta.manager):
                out = build(batch, pcp)
                blocks = {int(s) // manager.block_size for s in out.slot_mapping.tolist() if s >= 0}
                written.append(max((manager.pool.refs(b) for b in blocks), default=1))
                return out
            meta.build = build
    reqs = shared_prefix_requests(14, seed=31)
    assert_runs_equal(run_pipeline(folder, reqs, ranges, {2: 6}, seed=5, stages=(head, workers)),
                      run_engine(folder, reqs, prefix_cache=False), len(reqs))
    assert written and max(written) == 1
    assert head.engine.prefix is None or head.engine.prefix.stats.hit_tokens > 0


def test_a_step_failed_on_one_stage_resets_every_pool_before_the_next_hit(folder):
    """A step that fails on stage 2 (after stage 0 and 1 ran it) leaves the pools out of step: no
    hit until no request holds KV, then every stage's pools reset together, and a second wave of
    requests hits the blocks the reset pools cache anew, with the uncached engine's tokens."""
    ranges = [(0, 2), (2, 4), (4, 5)]
    head, workers = make_stages(folder, ranges)
    model = workers[1].executor.model
    forward, calls = model.forward, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("injected failure")
        return forward(*args, **kwargs)

    model.forward = failing_once
    resets = []
    for ex in [head.engine.executor] + [w.executor for w in workers]:
        ex.reset_kv = lambda reset=ex.reset_kv: (resets.append(1), reset())
    first, second = shared_prefix_requests(12, seed=21), shared_prefix_requests(8, seed=22)
    got = run_pipeline(folder, first, ranges, {}, seed=1, stages=(head, workers))
    failed = {rid for rid, (_, reason) in got.items() if reason == "error"}
    expected = run_engine(folder, first, prefix_cache=False)
    assert failed and all(got[rid] == expected[rid] for rid in got if rid not in failed)
    if not resets:  # no moment without a running request until the end: the reset goes out now
        list(map(wire, head.launch()))
        for worker in workers:
            worker.handle(wire(protocol.to_frame(protocol.ResetKV(), stage_from=0, stage_to=worker.index)))
    assert len(resets) == 3 and not head.engine.kv_reset_due
    hits = 0 if head.engine.prefix is None else head.engine.prefix.stats.hit_tokens
    got = run_pipeline(folder, second, ranges, {}, seed=2, stages=(head, workers))
    assert got == run_engine(folder, second, prefix_cache=False)
    assert head.engine.prefix is None or head.engine.prefix.stats.hit_tokens > hits

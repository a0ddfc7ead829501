"""The pipeline's stage logic in one process, without transport: a PipelineHead (stage 0) and
StageRuntimes (later stages) whose steps overlap as in a pipeline (several microbatch groups in
flight, handed from stage to stage in an interleaved order) give exactly the tokens of the
single-process Engine — greedy and seeded sampling, with cancellations in between."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from stagewise.model.loader import load_stage_weights, open_checkpoint
from stagewise.model.stage import StageModel
from stagewise.parallel import StagePlan
from stagewise.runtime.engine import Engine
from stagewise.runtime.pipeline_head import PipelineHead
from stagewise.runtime.sampling import SamplingParams
from stagewise.runtime.stage_runtime import StageRuntime, rows_of

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=101, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=128, bos_token_id=1, eos_token_id=None)
BLOCK = 4
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=16)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    return path


def stage_model(folder, start: int, end: int) -> StageModel:
    ckpt = open_checkpoint(folder)
    weights = load_stage_weights(ckpt, start, end, dtype=torch.float32)
    return StageModel.from_weights(ckpt.config, start, end, weights)


def requests(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 101) for _ in range(rng.randint(1, 13))]
        sampled = i % 3 == 1
        out.append((prompt, SamplingParams(max_new_tokens=rng.randint(1, 9), temperature=0.8 if sampled else 0.0,
                                           top_k=20 if sampled else 0, seed=100 + i, ignore_eos=True)))
    return out


def run_engine(folder, reqs, cancel_at: dict[int, int]) -> dict[int, tuple[list[int], str]]:
    engine = Engine(stage_model(folder, 0, 5), max_num_seqs=6, max_model_len=64, block_size=BLOCK,
                    max_num_tokens=NUM_BLOCKS * BLOCK)
    for rid, (prompt, params) in enumerate(reqs):
        engine.add_request(rid, prompt, params)
    results, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id] = (out.token_ids, out.finish_reason)
        steps += 1
        for rid, at in cancel_at.items():
            if at == steps and (out := engine.cancel(rid)) is not None:
                results[rid] = (out.token_ids, out.finish_reason)
    return results


def run_pipeline(folder, reqs, ranges, cancel_at: dict[int, int], seed: int):
    """Stages joined by queues; each round moves one ready item at a random stage."""
    head = PipelineHead(stage_model(folder, *ranges[0]), num_groups=len(ranges), num_blocks=NUM_BLOCKS,
                        max_num_seqs=6, max_model_len=64, block_size=BLOCK)
    later = [StageRuntime(stage_model(folder, a, b), num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=64)
             for a, b in ranges[1:]]
    queues = [collections.deque() for _ in later]  # inbox of each later stage
    feedback = collections.deque()  # last stage -> head
    for rid, (prompt, params) in enumerate(reqs):
        head.add_request(rid, prompt, params)
    rng, results, rounds = random.Random(seed), {}, 0

    def record(outs):
        for out in outs:
            results[out.request_id] = (out.token_ids, out.finish_reason)

    while head.has_unfinished() or head.has_freed or any(queues) or feedback:
        rounds += 1
        assert rounds < 10_000
        for g in head.idle_groups_with_work():
            step, done = head.launch(g)
            record(done)
            if step is not None:
                queues[0].append(("step", step.group, step.step_id, rows_of(step.batch), step.hidden_states,
                                  step.sampling))
        freed = head.take_freed()
        if freed:
            queues[0].append(("free", freed))
        ready = [i for i, q in enumerate(queues) if q] + (["fb"] if feedback else [])
        if not ready:
            continue
        pick = rng.choice(ready)
        if pick == "fb":
            group, step_id, rids, tokens = feedback.popleft()
            record(head.on_tokens(group, step_id, rids, tokens))
            for rid, at in cancel_at.items():
                if at <= rounds and rid not in results and (out := head.cancel(rid)) is not None:
                    record([out])
            continue
        item = queues[pick].popleft()
        stage = later[pick]
        if item[0] == "free":
            stage.free(item[1])
            if pick + 1 < len(later):
                queues[pick + 1].append(item)
            continue
        _, group, step_id, rows, hidden, sampling = item
        out = stage.run(rows, hidden, sampling)
        if stage.is_last:
            feedback.append((group, step_id, [r.request_id for r in rows], out.tolist()))
        else:
            queues[pick + 1].append(("step", group, step_id, rows, out, sampling))
    # Every stage freed every request's KV.
    assert head.manager.num_free_blocks == NUM_BLOCKS
    assert all(s.manager.num_free_blocks == NUM_BLOCKS and not s._sampling for s in later)
    return results


@pytest.mark.parametrize("partition", ["even", "0-1,1-4,4-5", "balanced"])
def test_overlapping_microbatches_equal_the_single_process_engine(folder, partition):
    reqs = requests(14, seed=3)
    expected = run_engine(folder, reqs, {})
    plan = StagePlan.build(5, 3, partition, costs=([1.0] * 5, 0.5, 2.0))
    got = run_pipeline(folder, reqs, plan.ranges, {}, seed=11)
    assert got == expected


def test_two_and_five_stages_with_cancellations(folder):
    reqs = requests(10, seed=5)
    expected = run_engine(folder, reqs, {})
    for ranges in ([(0, 2), (2, 5)], [(i, i + 1) for i in range(5)]):
        got = run_pipeline(folder, reqs, ranges, {2: 7, 5: 30}, seed=len(ranges))
        for rid, (tokens, reason) in got.items():
            if reason == "cancelled":
                # A prefix of the uncancelled run, cut where the cancel landed.
                assert tokens == expected[rid][0][: len(tokens)]
            else:
                assert (tokens, reason) == expected[rid], rid
        assert sorted(got) == list(range(len(reqs)))
        assert sum(reason == "cancelled" for _, reason in got.values()) >= 1


def test_a_failing_later_stage_ends_only_that_step(folder):
    head = PipelineHead(stage_model(folder, 0, 2), num_groups=2, num_blocks=NUM_BLOCKS, max_num_seqs=4,
                        max_model_len=64, block_size=BLOCK)
    head.add_request(0, [5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0.0))
    head.add_request(1, [8, 9], SamplingParams(max_new_tokens=3, temperature=0.0))
    (g0, g1) = head.idle_groups_with_work()
    step0, _ = head.launch(g0)
    step1, _ = head.launch(g1)
    done = head.on_step_failed(step0.group, step0.step_id, "stage 1 failed: boom")
    assert [(o.request_id, o.finish_reason, o.error) for o in done] == [(0, "error", "stage 1 failed: boom")]
    assert head.take_freed() == [0]
    with pytest.raises(ValueError, match="no step 99 in flight for group"):
        head.on_tokens(step1.group, 99, [1], [3])
    assert head.on_tokens(step1.group, step1.step_id, [1], [42]) == []
    assert head.has_unfinished()


def test_kv_handoff_moves_a_request_between_two_stage_instances(folder):
    """Run a request on one instance of the last stage, move its KV (through the wire codec) to
    a second instance, continue there: the tokens are those of the engine, with seeded sampling."""
    from stagewise.runtime.kv_handoff import export_kv, import_kv
    from stagewise.transport import decode_frame, encode_frame

    prompt, params = [5, 9, 14, 3, 77, 21], SamplingParams(max_new_tokens=10, temperature=0.7, top_k=30, seed=5,
                                                            ignore_eos=True)
    expected = run_engine(folder, [(prompt, params)], {})[0][0]
    head = PipelineHead(stage_model(folder, 0, 2), num_groups=1, num_blocks=NUM_BLOCKS, max_num_seqs=2,
                        max_model_len=64, block_size=BLOCK)
    first, second = (StageRuntime(stage_model(folder, 2, 5), num_blocks=NUM_BLOCKS, block_size=BLOCK,
                                  max_model_len=64) for _ in range(2))
    second.manager.add("someone-else", 7)  # a busy instance: the request lands on other blocks
    head.add_request(0, prompt, params)
    stage, tokens = first, []
    while head.has_unfinished():
        step, _ = head.launch(0)
        out = stage.run(rows_of(step.batch), step.hidden_states, step.sampling).tolist()
        tokens += out
        head.on_tokens(0, step.step_id, [0], out)
        if len(tokens) == 4:  # move mid-generation
            frame = decode_frame(encode_frame(export_kv(first, 0, stage=1)))
            first.free([0])
            import_kv(second, frame)
            stage = second
    assert tokens == expected
    with pytest.raises(ValueError, match="holds layers"):
        import_kv(StageRuntime(stage_model(folder, 1, 5), num_blocks=8, block_size=BLOCK, max_model_len=64), frame)

"""The scheduler's chunked prefill without a model: a step's prompt tokens stay within
max_prefill_tokens, prompts already started go first, the running rows decode in the same steps,
and only the chunk that ends a prompt samples."""

from __future__ import annotations

import pytest

from stagewise.engine.scheduler import GroupedScheduler, Scheduler, SeqState
from stagewise.kv.budget import GroupPool, KVBudget


def scheduler(budget: int, rows: int = 4) -> Scheduler:
    blocks = KVBudget([GroupPool(window=None, num_blocks=32)], block_size=4, max_blocks_per_seq=8)
    return Scheduler(blocks, max_num_seqs=rows, max_model_len=32, max_prefill_tokens=budget)


def run_step(s: Scheduler) -> tuple[list[tuple[str, int, int]], list[str], list[str]]:
    """One step: its chunks (id, start, length), decodes and sampled ids; each sampled request gets
    a token, as the engine records them."""
    step = s.schedule()
    for seq in step.sampled:
        seq.output_ids.append(7)
    return ([(c.seq.request_id, c.start, c.length) for c in step.prefills], [q.request_id for q in step.decodes],
            [q.request_id for q in step.sampled])


def test_a_long_prompt_is_prefilled_in_chunks_beside_decodes():
    s = scheduler(budget=5)
    for rid, n in (("a", 3), ("b", 12), ("c", 4)):
        s.add(SeqState(request_id=rid, prompt_ids=list(range(1, n + 1))))
    assert run_step(s) == ([("a", 0, 3), ("b", 0, 2)], [], ["a"])
    assert run_step(s) == ([("b", 2, 5)], ["a"], ["a"])              # b first: c waits for budget
    assert run_step(s) == ([("b", 7, 5)], ["a"], ["b", "a"])         # b's last chunk samples
    assert run_step(s) == ([("c", 0, 4)], ["a", "b"], ["c", "a", "b"])
    assert s.budget.num_tokens("b") == 12 + 1                        # blocks for the whole prompt at once


def test_a_step_budget_lowers_the_prompt_tokens_and_the_requests_started():
    s = scheduler(budget=8, rows=4)
    for rid, n in (("a", 3), ("b", 6), ("c", 2), ("d", 2)):
        s.add(SeqState(request_id=rid, prompt_ids=list(range(1, n + 1))))
    step = s.schedule(prefill_budget=5, new_rows=1)  # a only: one request may start
    assert [(c.seq.request_id, c.start, c.length) for c in step.prefills] == [("a", 0, 3)]
    step.sampled[0].output_ids.append(7)
    step = s.schedule(prefill_budget=4)  # b's first 4 tokens; the budget ends the step's prompts
    assert [(c.seq.request_id, c.start, c.length) for c in step.prefills] == [("b", 0, 4)]
    assert [q.request_id for q in step.decodes] == ["a"]
    step = s.schedule(prefill_budget=0, new_rows=3)  # no prompt tokens: decodes only
    assert step.prefills == [] and [q.request_id for q in step.decodes] == ["a"]
    step = s.schedule(prefill_budget=100, new_rows=0)  # b goes on; no new request starts
    assert [(c.seq.request_id, c.start, c.length) for c in step.prefills] == [("b", 4, 2)]
    step = s.schedule(prefill_budget=100)  # max_prefill_tokens (8) still holds
    assert [(c.seq.request_id, c.length) for c in step.prefills] == [("c", 2), ("d", 2)]


@pytest.mark.parametrize("budget", [1, 3, 4, 100])
def test_every_prompt_token_is_scheduled_once_in_order(budget):
    s = scheduler(budget=budget, rows=2)
    prompts = {rid: list(range(n)) for rid, n in (("a", 9), ("b", 1), ("c", 6))}
    for rid, prompt in prompts.items():
        s.add(SeqState(request_id=rid, prompt_ids=prompt))
    seen = {rid: 0 for rid in prompts}
    for _ in range(40):
        chunks, _, _ = run_step(s)
        assert sum(n for _, _, n in chunks) <= budget
        for rid, start, n in chunks:
            assert start == seen[rid] and n >= 1
            seen[rid] += n
        for rid in [r for r, seq in s.running.items() if len(seq.output_ids) >= 2]:
            s.finish(rid)
    assert seen == {rid: len(p) for rid, p in prompts.items()} and not s.has_unfinished()


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_a_budget_below_one_token_is_refused_naming_the_option(budget):
    with pytest.raises(ValueError, match=f"max_prefill_tokens must be an int >= 1, got {budget!r}"):
        scheduler(budget=budget)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        GroupedScheduler(scheduler(1).budget, num_groups=2, max_num_seqs=2, max_model_len=32,
                         max_prefill_tokens=budget)


def grouped(groups: int = 2, rows: int = 8) -> GroupedScheduler:
    blocks = KVBudget([GroupPool(window=None, num_blocks=64)], block_size=4, max_blocks_per_seq=8)
    return GroupedScheduler(blocks, num_groups=groups, max_num_seqs=rows, max_model_len=32)


def test_groups_admit_from_one_queue_each_its_fair_share():
    """Requests wait in one queue: whichever group is scheduled starts them, up to its share of
    the requests running and waiting, so a request never waits behind a group while another could
    start it, and the groups stay as full as each other."""
    s = grouped()
    for rid in "abcde":
        s.add(SeqState(request_id=rid, prompt_ids=[1, 2, 3]))
    first = s.schedule(0)
    assert [c.seq.request_id for c in first.prefills] == ["a", "b", "c"]  # ceil(5 / 2) = 3
    second = s.schedule(1)
    assert [c.seq.request_id for c in second.prefills] == ["d", "e"]
    for seq in first.sampled + second.sampled:
        seq.output_ids.append(7)
    s.finish("d"), s.finish("e")  # group 1 empties: the next request goes there, not behind group 0
    s.add(SeqState(request_id="f", prompt_ids=[4]))
    assert s.schedule(0).prefills == [] and s.status().waiting == 1
    assert [c.seq.request_id for c in s.schedule(1).prefills] == ["f"]
    assert s.finish("f").request_id == "f" and s.finish("a").request_id == "a" and s.finish("zz") is None
    with pytest.raises(ValueError, match="request id 'b' is already in use"):
        s.add(SeqState(request_id="b", prompt_ids=[1]))
    s.add(SeqState(request_id="g", prompt_ids=[1]))
    with pytest.raises(ValueError, match="request id 'g' is already in use"):
        s.add(SeqState(request_id="g", prompt_ids=[1]))
    assert s.finish("g").row is None and not s.waiting  # a waiting request is taken off the queue

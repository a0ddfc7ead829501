"""Requests that outlive a stage: a stage process killed or hung mid-generation, the pipeline
started again, and every running request ends with exactly the greedy tokens of an undisturbed
run; the old processes are gone; past max_restarts a failure ends the requests as before."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from processes import alive, gone
from stagewise.api import Pipeline

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "def fib(n):"]
NEW = 40


@pytest.fixture(scope="module")
def reference():
    with Pipeline("smollm2-135m") as pipe:
        return [c.token_ids for c in pipe.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)]


def fail_stage_midway(pipe, sig) -> tuple[list[int], callable]:
    """An on_text callback that sends ``sig`` to the last stage once tokens flow; the stage pids."""
    pids = list(pipe.driver.processes.pids)
    seen = {"n": 0, "sent": False}

    def on_text(i, text):
        seen["n"] += 1
        if seen["n"] == 12 and not seen["sent"]:
            seen["sent"] = True
            os.kill(pids[-1], sig)
            if sig == signal.SIGSTOP:  # let the driver's heartbeat watch notice, then let it go
                threading.Timer(8.0, lambda: os.kill(pids[-1], signal.SIGCONT) if alive(pids[-1]) else None).start()

    return pids, on_text


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_running_requests_survive_a_stage(reference, sig):
    with Pipeline("smollm2-135m", stages=2, max_restarts=1) as pipe:
        pids, on_text = fail_stage_midway(pipe, sig)
        out = pipe.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True, on_text=on_text)
        assert pipe.restarts == 1
        assert [c.finish_reason for c in out] == ["length"] * len(PROMPTS), [c.error for c in out]
        assert [c.token_ids for c in out] == reference
        assert [len(c.prompt_token_ids) for c in out] == [len(pipe.tokenizer.encode(p).ids) for p in PROMPTS]
        assert gone(pids), "the failed pipeline's processes are left"
        new = list(pipe.driver.processes.pids)
        assert not set(new) & set(pids) and all(alive(p) for p in new)
        # the new pipeline serves on
        [again] = pipe.generate([PROMPTS[0]], max_new_tokens=NEW, ignore_eos=True)
        assert again.token_ids == reference[0]
    assert gone(new)


def test_past_max_restarts_the_requests_end_with_the_error():
    with Pipeline("smollm2-135m", stages=2, max_restarts=1) as pipe:
        for attempt in range(2):
            _, on_text = fail_stage_midway(pipe, signal.SIGKILL)
            out = pipe.generate(PROMPTS[:2], max_new_tokens=NEW, ignore_eos=True, on_text=on_text)
            if attempt == 0:
                assert all(c.finish_reason == "length" for c in out)
        assert all(c.finish_reason == "error" and "stage 1" in c.error for c in out), [c.error for c in out]
        assert pipe.restarts == 1 and pipe.broken


def test_max_restarts_is_checked():
    with pytest.raises(ValueError, match="max_restarts must be an int >= 0"):
        Pipeline("smollm2-135m", stages=2, max_restarts=-1)
    with pytest.raises(ValueError, match="max_restarts applies to stage processes"):
        Pipeline("smollm2-135m", max_restarts=1)

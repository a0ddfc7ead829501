"""Requests that outlive a stage: a stage process killed or hung mid-generation, only that stage
started again (the others drop their KV and rejoin with their layers loaded), and every running
request ends with exactly the greedy tokens of an undisturbed run; a run whose stages cannot
rejoin (a torch.distributed world) starts every stage again; stages started by hand come back at
their addresses; past max_restarts a failure ends the requests as before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from helpers.processes import alive, gone
from stagewise.api import Pipeline

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "def fib(n):"]
NEW = 40


@pytest.fixture(scope="module")
def reference():
    with Pipeline("smollm2-135m") as pipe:
        return [c.token_ids for c in pipe.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)]


def fail_stage_midway(pid: int, sig, after: int = 12):
    """An on_text callback that sends ``sig`` to ``pid`` once ``after`` texts have streamed."""
    seen = {"n": 0, "sent": False}

    def on_text(i, text):
        seen["n"] += 1
        if seen["n"] == after and not seen["sent"]:
            seen["sent"] = True
            os.kill(pid, sig)
            if sig == signal.SIGSTOP:  # let the driver's heartbeat watch notice, then let it go
                threading.Timer(8.0, lambda: os.kill(pid, signal.SIGCONT) if alive(pid) else None).start()

    return on_text


def check_resumed(pipe, out, reference) -> None:
    assert pipe.restarts == 1
    assert [c.finish_reason for c in out] == ["length"] * len(PROMPTS), [c.error for c in out]
    assert [c.token_ids for c in out] == reference
    assert [len(c.prompt_token_ids) for c in out] == [len(pipe.tokenizer.encode(p).ids) for p in PROMPTS]
    # the repaired pipeline serves on
    [again] = pipe.generate([PROMPTS[0]], max_new_tokens=NEW, ignore_eos=True)
    assert again.token_ids == reference[0]


@pytest.mark.parametrize("stages,lost,sig", [(2, 1, signal.SIGKILL), (2, 1, signal.SIGSTOP), (3, 1, signal.SIGKILL),
                                             (3, 0, signal.SIGKILL)],
                         ids=["last-killed", "last-hung", "middle-killed", "head-killed"])
def test_only_the_lost_stage_starts_again(reference, stages, lost, sig):
    with Pipeline("smollm2-135m", stages=stages, max_restarts=1) as pipe:
        pids = list(pipe.driver.processes.pids)
        out = pipe.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True, on_text=fail_stage_midway(pids[lost], sig))
        assert gone([pids[lost]]), "the lost stage's process is left"
        new = list(pipe.driver.processes.pids)
        assert [p == q for p, q in zip(pids, new)] == [i != lost for i in range(stages)], (pids, new)
        assert all(alive(p) for p in new)
        check_resumed(pipe, out, reference)
    assert gone(new)


@pytest.mark.parametrize("lost", [0, 1], ids=["head-killed", "last-killed"])
def test_a_stage_killed_mid_speculation_resumes_exactly(reference, lost):
    """Requests verifying drafts (some rejected, their KV rolled back on every stage) when a stage
    is killed: resumed on the repaired pipeline, they end with the undisturbed single process's
    tokens without drafts."""
    with Pipeline("smollm2-135m", stages=2, max_restarts=1, speculative="ngram", num_speculative_tokens=4) as pipe:
        pids = list(pipe.driver.processes.pids)
        out = pipe.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True,
                            on_text=fail_stage_midway(pids[lost], signal.SIGKILL, after=30))
        assert sum(c.draft_tokens for c in out) > 0
        check_resumed(pipe, out, reference)


def test_a_stage_lost_under_a_shared_prefix_load_gives_the_undisturbed_answers():
    """Prompts behind one shared beginning, which an earlier request left cached; stage 1 is killed
    mid-generation, and the repaired pipeline (every pool new: no block of the old cache is
    named) resumes them with the uncached single process's tokens, then caches the prefix anew."""
    shared = "You are a careful assistant. Answer in one short sentence, and never repeat the question. "
    prompts = [shared + p for p in PROMPTS]
    with Pipeline("smollm2-135m", prefix_cache=False) as single:
        want = [c.token_ids for c in single.generate(prompts, max_new_tokens=NEW, ignore_eos=True)]
    with Pipeline("smollm2-135m", stages=2, max_restarts=1) as pipe:
        pipe.generate([shared + "Hello"], max_new_tokens=2, ignore_eos=True)
        pids = list(pipe.driver.processes.pids)
        out = pipe.generate(prompts, max_new_tokens=NEW, ignore_eos=True,
                            on_text=fail_stage_midway(pids[1], signal.SIGKILL, after=20))
        # (Resumed on the new pipeline, each prompt with its tokens so far computed again: the
        # cached_tokens reported are the new pipeline's.)
        assert pipe.restarts == 1 and [c.token_ids for c in out] == want
        again = pipe.generate(prompts, max_new_tokens=NEW, ignore_eos=True)
        assert [c.token_ids for c in again] == want and all(c.cached_tokens >= 16 for c in again)


def test_a_stage_lost_between_requests_is_repaired_before_the_next(reference):
    """Stage 0 killed, then stage 1 stopped (hung), while nothing runs: the next generate repairs
    the pipeline first (the next request's send fails; the stats call finds the silent stage)."""
    with Pipeline("smollm2-135m", stages=2, max_restarts=2) as pipe:
        pids = list(pipe.driver.processes.pids)
        os.kill(pids[0], signal.SIGKILL)
        assert gone([pids[0]])
        out = pipe.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)
        assert [c.token_ids for c in out] == reference and pipe.restarts == 1
        now = list(pipe.driver.processes.pids)
        assert now[1] == pids[1] and now[0] != pids[0]
        os.kill(now[1], signal.SIGSTOP)
        try:
            out = pipe.generate(PROMPTS[:1], max_new_tokens=NEW, ignore_eos=True)
        finally:
            if alive(now[1]):
                os.kill(now[1], signal.SIGCONT)
        assert out[0].token_ids == reference[0] and pipe.restarts == 2
        assert gone([now[1]]) and pipe.driver.processes.pids[0] == now[0]


def test_a_run_that_cannot_rejoin_starts_every_stage_again(reference):
    """Stages joined by torch.distributed (a world cannot take a new member): all started anew."""
    with Pipeline("smollm2-135m", stages=2, transport="torch", max_restarts=1) as pipe:
        pids = list(pipe.driver.processes.pids)
        out = pipe.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True,
                            on_text=fail_stage_midway(pids[-1], signal.SIGKILL))
        assert gone(pids), "the failed pipeline's processes are left"
        new = list(pipe.driver.processes.pids)
        assert not set(new) & set(pids) and all(alive(p) for p in new)
        check_resumed(pipe, out, reference)
    assert gone(new)


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory):
    """A random Llama of 4 query and 2 KV heads (tp 2 halves both), with a word-per-token tokenizer
    (text streams as the tokens come back)."""
    import torch

    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=256)).eval()
    path = tmp_path_factory.mktemp("llama-gqa")
    hf.save_pretrained(path)
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 101)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def test_a_stage_of_several_ranks_keeps_its_world_or_starts_again_whole(tiny_gqa):
    """Two stages of two TP ranks (each stage its own torch.distributed world). Stage 0's second
    rank killed mid-generation: both of stage 0's ranks start again (its world cannot take a new
    member), while stage 1's two ranks rejoin with their layers and their world; then stage 1's
    leader killed: stage 1 starts again whole and stage 0's new ranks rejoin. The answers are the
    undisturbed run's each time."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    with Pipeline(tiny_gqa, stages=2, tp=2, max_model_len=256, max_num_seqs=4, max_restarts=2) as pipe:
        assert pipe.driver.processes.pids and len(pipe.plan.members) == 4
        want = [c.token_ids for c in pipe.generate(prompt_token_ids=prompts, max_new_tokens=NEW, ignore_eos=True)]
        for victim, restarted in [(1, [0, 1]), (2, [2, 3])]:
            pids = list(pipe.driver.processes.pids)
            out = pipe.generate(prompt_token_ids=prompts, max_new_tokens=NEW, ignore_eos=True,
                                on_text=fail_stage_midway(pids[victim], signal.SIGKILL))
            assert [c.finish_reason for c in out] == ["length"] * 3, [c.error for c in out]
            assert [c.token_ids for c in out] == want
            new = list(pipe.driver.processes.pids)
            assert [p != q for p, q in zip(pids, new)] == [i in restarted for i in range(4)], (pids, new)
            assert gone([pids[i] for i in restarted]) and all(alive(p) for p in new)
            # a rejoined leader's counters start with its new executor (its world's outlive the break)
            stats = pipe.stage_stats()
            assert all(st["fanout_bytes"] > 0 and st["fanout_s"] >= 0 and st["collective_bytes"] > 0
                       for st in stats), stats
        assert pipe.restarts == 2
    assert gone(new)


def test_stages_started_by_hand_rejoin(reference, tmp_path):
    """Stages on their "hosts" (started here by hand with --rejoin, fixed ports): the last is
    killed and, as its host's supervisor would, started again at its address; the driver waits for
    it, stage 0 rejoins with its layers loaded, and the requests go on."""
    from stagewise.launch.multihost import load_plan

    path = two_stage_plan(tmp_path)

    def start(i):
        return start_by_hand(path, i, rejoin_s=60)

    procs = [start(0), start(1)]
    again = []
    try:
        pipe = Pipeline.attach(load_plan(str(path)), max_restarts=1, rejoin_timeout=60.0)
        with pipe:
            def restart():  # what the host's supervisor does
                procs[1].wait()
                again.append(start(1))

            seen = {"n": 0}

            def on_text(i, text):
                seen["n"] += 1
                if seen["n"] == 12:
                    os.kill(procs[1].pid, signal.SIGKILL)
                    again.append(threading.Thread(target=restart))
                    again[0].start()

            out = pipe.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True, on_text=on_text)
            assert procs[0].poll() is None, "stage 0 should have rejoined, not restarted"
            assert len(again) == 2 and again[1].poll() is None
            check_resumed(pipe, out, reference)
    finally:
        for proc in procs + again[1:]:
            proc.kill()
            proc.wait()


def test_a_stage_no_driver_rejoins_exits(tmp_path):
    """A stage waits --rejoin seconds for a driver after its pipeline broke, then exits: no orphan."""
    from stagewise.launch.multihost import load_plan

    path = two_stage_plan(tmp_path)
    procs = [start_by_hand(path, i, rejoin_s=1) for i in range(2)]
    try:
        pipe = Pipeline.attach(load_plan(str(path)))
        pipe.driver.close(force=True, keep=True)  # the driver goes away without a word
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    bad = subprocess.run([sys.executable, "-m", "stagewise.cli", "stage", "--plan", str(path), "--stage", "0",
                          "--rejoin", "-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--rejoin must be >= 0 seconds, got -1" in bad.stderr


def two_stage_plan(tmp_path):
    """A plan of two SmolLM2 stages on fixed loopback ports."""
    import socket

    from stagewise.model.loader import open_checkpoint

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    layers = open_checkpoint("smollm2-135m").config.num_layers
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"model": "smollm2-135m", "stages": [
        {"host": "127.0.0.1", "listen": f"127.0.0.1:{ports[i]}", "layers": f"{i * layers // 2}-{(i + 1) * layers // 2}"}
        for i in range(2)]}))
    return path


def start_by_hand(path, index: int, rejoin_s: float) -> subprocess.Popen:
    """``stagewise stage --plan PATH --stage INDEX --rejoin S``, once it listens."""
    from stagewise.launch.local import read_address

    proc = subprocess.Popen([sys.executable, "-m", "stagewise.cli", "stage", "--plan", str(path), "--stage",
                             str(index), "--rejoin", str(rejoin_s)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    read_address(proc, index, 120.0)
    return proc


def test_past_max_restarts_the_requests_end_with_the_error():
    with Pipeline("smollm2-135m", stages=2, max_restarts=1) as pipe:
        for attempt in range(2):
            on_text = fail_stage_midway(pipe.driver.processes.pids[-1], signal.SIGKILL)
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
    with pytest.raises(ValueError, match="rejoin must be True or False, got 'no'"):
        Pipeline("smollm2-135m", stages=2, max_restarts=1, rejoin="no")


def test_repairing_says_why_while_the_stages_start_again():
    """What a server's /health reads: the reason while a restart is due or under way, None once the
    pipeline serves again, and once it failed for good (``broken`` then says why)."""
    from stagewise.pipeline.recovery import Recovering

    class Driver:  # a driver's face as Recovering sees it
        def __init__(self, broken=None):
            self.broken = broken

        def poll(self, timeout):
            return []

        def take_tokens(self):
            return []

        def close(self, force=False):
            pass

    seen = []

    def restart(old):
        seen.append(recovering.repairing)
        if len(seen) == 2:
            raise RuntimeError("its host is gone")
        return Driver()

    recovering = Recovering(Driver(), restart, max_restarts=2)
    assert recovering.repairing is None
    recovering.driver.broken = "stage 1 process exited with signal 9"
    assert recovering.repairing == "stage 1 process exited with signal 9" and recovering.broken is None
    recovering.poll(0.0)
    assert seen == ["stage 1 process exited with signal 9"] and recovering.repairing is None
    recovering.driver.broken = "stage 1 sent nothing for 3.0 s"
    recovering.poll(0.0)  # this restart fails: the pipeline is broken for good
    assert seen[1] == "stage 1 sent nothing for 3.0 s" and recovering.repairing is None
    assert "its host is gone" in recovering.broken

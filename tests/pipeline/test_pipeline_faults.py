"""Faults and bad input against live stage processes: a stage killed or hung mid-generation, a
port already in use, a wrong auth token or fingerprint, and thousands of malformed or
mismatched frames fed to a live stage, which rejects each with a logged error and keeps serving."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import stagewise
from stagewise.engine.params import SamplingParams
from stagewise.launch.local import read_address, spawn_stages
from stagewise.parallel.runplan import RunPlan
from stagewise.pipeline import links, messages, protocol
from stagewise.pipeline.driver import PipelineDriver
from stagewise.transport import encode_frame
from stagewise.transport.errors import HandshakeError
from stagewise.transport.frame import Frame, Row, StepKind

from helpers.processes import children as process_children, ended_by_ctrl_c, gone

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SMALL = dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, max_position_embeddings=512)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL)).eval()
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    # A word per token id: text streams as the tokens come back.
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, SMALL["vocab_size"])}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_dead_or_hung_stage_ends_requests_with_an_error_naming_it(folder, fault):
    pipe = stagewise.Pipeline(str(folder), stages=3, max_model_len=500, max_num_seqs=4)
    pids = pipe.driver.processes.pids
    struck = []

    def strike(_index: int, _text: str) -> None:
        # Once the first tokens come back: mid-generation, whatever the machine's speed.
        if not struck:
            os.kill(pids[1], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            struck.append(time.monotonic())

    try:
        outs = pipe.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], max_new_tokens=480, ignore_eos=True,
                             on_text=strike)
        ended = time.monotonic()
    finally:
        pipe.close()
    assert struck, "no token came back before the fault"
    assert ended - struck[0] < 5.0
    for out in outs:
        assert out.finish_reason == "error" and "stage 1" in out.error, out.error
    assert any(out.token_ids for out in outs), "the tokens generated before the failure are kept"
    assert all(len(out.token_ids) < 480 for out in outs)
    assert gone(pids), "stage processes left behind"
    with pytest.raises(ValueError, match="closed"):
        pipe.generate(prompt_token_ids=[[1, 2]], max_new_tokens=2)


def test_port_in_use_is_a_clear_error(folder, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    plan = RunPlan.build(str(folder), 4, 2).with_stage(0, listen=f"127.0.0.1:{port}")
    run = subprocess.run([sys.executable, "-m", "stagewise.cli", "stage", "--plan-json", plan.to_json(), "--stage", "0"],
                         capture_output=True, text=True, timeout=120)
    busy.close()
    assert run.returncode == 1
    assert f"127.0.0.1:{port}" in run.stderr and "already in use" in run.stderr, run.stderr


def test_auth_token_and_fingerprint_are_checked(folder):
    from stagewise.model.loader import open_checkpoint

    plan = RunPlan.build(str(folder), 4, 2)
    fingerprint = plan.fingerprint(open_checkpoint(str(folder)).hf_config)
    procs, addresses = spawn_stages(plan, auth_token="right-token")
    try:
        with pytest.raises(HandshakeError, match="auth"):
            PipelineDriver(plan, addresses, fingerprint=fingerprint, auth_token="wrong-token")
        with pytest.raises(HandshakeError, match="auth"):
            PipelineDriver(plan, addresses, fingerprint=fingerprint, auth_token=None)
        with pytest.raises(HandshakeError, match=rf"0123456789abcdef.*{fingerprint}|{fingerprint}.*0123456789abcdef"):
            PipelineDriver(plan, addresses, fingerprint="0123456789abcdef", auth_token="right-token")
        assert all(procs.exit_code(i) is None for i in range(2)), "a refused connection must not stop a stage"
        driver = PipelineDriver(plan, addresses, fingerprint=fingerprint, auth_token="right-token")
        driver.add(0, [5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
        results = []
        while not results:
            results = driver.poll(0.1)
        assert results[0].finish_reason == "length" and len(results[0].token_ids) == 3
        driver.close()
    finally:
        procs.stop(grace_s=5.0)


def test_a_stage_started_with_another_plans_transport_is_named(folder):
    """The fingerprint leaves hosts and transports out (they may differ between hosts' views), so
    each stage checks the driver's setup against its own plan: stages started with the ``torch``
    transport (one world over the run) meet a driver whose plan says ``tcp``, and say so at once."""
    from stagewise.model.loader import open_checkpoint

    stage_plan = RunPlan.build(str(folder), 4, 2, transport="torch")
    plan = RunPlan.build(str(folder), 4, 2, transport="tcp")
    fingerprint = plan.fingerprint(open_checkpoint(str(folder)).hf_config)
    assert stage_plan.fingerprint(open_checkpoint(str(folder)).hf_config) == fingerprint
    procs, addresses = spawn_stages(stage_plan)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"over 'tcp', but this stage's plan makes it 'torch'.*another plan"):
            PipelineDriver(plan, addresses, fingerprint=fingerprint)
        assert time.monotonic() - started < 30
    finally:
        procs.stop(grace_s=5.0)


def test_a_live_stage_rejects_thousands_of_bad_frames_and_serves_on(folder):
    """This test plays the driver and stage 0 (an in-process Head) against a real last stage
    process. Between valid steps it sends bursts of corrupted, truncated and mismatched frames;
    each is rejected and counted, and the valid steps still give the engine's tokens."""
    from stagewise.engine.engine import Engine
    from stagewise.engine.executor import Executor
    from stagewise.model.loader import open_checkpoint
    from stagewise.model.stage import load_stage
    from stagewise.pipeline.roles import Head

    ckpt = open_checkpoint(str(folder))
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    engine = Engine.for_model(load_stage(ckpt, 0, 4), max_num_seqs=4, max_model_len=64, max_num_tokens=256)
    for rid, p in enumerate(prompts):
        engine.add_request(rid, p, params)
    expected = {}
    while engine.has_unfinished():
        expected.update({o.request_id: o.token_ids for o in engine.step()})

    plan = RunPlan.build(str(folder), 4, 2, max_model_len=64, max_num_tokens=256)
    proc = subprocess.Popen([sys.executable, "-m", "stagewise.cli", "stage", "--plan-json", plan.to_json(),
                             "--stage", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = read_address(proc, 1, 120)
        options = links.LinkOptions(fingerprint=plan.fingerprint(ckpt.hf_config))
        acceptor = links.Acceptor(links.listen(("127.0.0.1", 0), options), stage=0)
        control = links.dial(address, options, transport="tcp", stage=-1, peer=1, role="driver")
        ready = messages.from_frame(control.recv(timeout=120))
        control.send(messages.to_frame(messages.Setup(num_blocks=ready.capacity_blocks,
                                                      next=acceptor.listener.address, transport="tcp",
                                                      microbatches=1)))
        up = links.dial(address, options, transport="tcp", stage=0, peer=1, role="activations")
        feedback = acceptor.take("feedback", 60)
        while not isinstance(messages.from_frame(control.recv(timeout=60)), messages.Connected):
            pass

        executor = Executor(load_stage(ckpt, 0, 2), num_blocks=ready.capacity_blocks, block_size=plan.block_size,
                            max_model_len=64)
        head = Head(Engine(executor, max_num_seqs=4))
        for rid, p in enumerate(prompts):
            head.on_message(messages.Add(request_id=rid, prompt_ids=p, params=params))
        rng, bad_sent, results = random.Random(0), 0, {}
        while head.busy:
            for frame in head.launch():
                good = encode_frame(frame)
                if frame.step_kind != StepKind.CONTROL:
                    for _ in range(250):
                        up.send_bytes(_mutate(rng, good, frame))
                        bad_sent += 1
                up.send(frame)
            if head.engine.inflight:
                reply = feedback.recv(timeout=60)
                assert reply.step_kind == StepKind.TOKENS
                for frame in head.on_feedback(protocol.from_frame(reply, None)):
                    up.send(frame)
            events = head.take_events()
            results.update({r.request_id: r.token_ids for r in events.done} if events else {})
        assert results == expected
        assert bad_sent >= 1000
        control.send(messages.to_frame(messages.GetStats()))
        while not isinstance(stats := messages.from_frame(control.recv(timeout=30)), messages.Stats):
            pass
        assert stats.rejected_frames == bad_sent
        assert proc.poll() is None
        control.send(messages.to_frame(messages.Shutdown()))
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "rejected frame #1 " in err and "bad frame" in err, err[-2000:]
        acceptor.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _mutate(rng: random.Random, good: bytes, frame: Frame) -> bytes:
    """A frame the stage must refuse: corrupted, truncated, or well formed but not fitting the
    plan (wrong stage, shape, dtype, unknown request, inconsistent rows)."""
    import dataclasses

    kind = rng.randrange(8)
    if kind == 0:  # flipped bits anywhere (the checksum or a field check catches them)
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 1:
        return good[: rng.randrange(len(good))]
    if kind == 2:  # a header claiming a payload far above the maximum
        data = bytearray(good)
        data[64:72] = (1 << 40).to_bytes(8, "little")
        return bytes(data)
    hidden = frame.tensors["hidden"]
    if kind == 3:
        bad = dataclasses.replace(frame, stage_to=7)
    elif kind == 4:
        bad = dataclasses.replace(frame, tensors={"hidden": hidden[:, :-1].contiguous()})
    elif kind == 5:
        bad = dataclasses.replace(frame, tensors={"hidden": hidden.double()})
    elif kind == 6:  # a decode row of a request this stage never saw
        bad = dataclasses.replace(frame, rows=[Row(10_000 + rng.randrange(1000), 5, 1)],
                                  tensors={"hidden": hidden[:1].contiguous()})
    else:  # rows that do not add up to the tensor
        bad = dataclasses.replace(frame, rows=frame.rows + [Row(3, 2, 1)])
    return encode_frame(bad)


CTRL_C_SCRIPT = """
import os, signal, sys
import stagewise

def strike(_index, _text):
    print("STRUCK", flush=True)
    os.killpg(0, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group

pipe = stagewise.Pipeline(sys.argv[1], stages=3, max_model_len=500, max_num_seqs=4)
print("PIDS", *pipe.driver.processes.pids, flush=True)
try:
    with pipe:
        pipe.generate(prompt_token_ids=[5, 6, 7], max_new_tokens=480, ignore_eos=True, on_text=strike)
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("when", ["starting", "generating"])
def test_ctrl_c_stops_the_driver_and_every_stage(folder, when):
    """SIGINT to the whole process group, as a terminal's Ctrl-C, while the stages start (the CLI)
    or in the middle of a generation (the Python API): exit 130, no traceback, no stage left."""
    if when == "generating":
        proc = subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT, str(folder)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        first = proc.stdout.readline().split()
        assert first and first[0] == "PIDS", first
        children = [int(x) for x in first[1:]]
        ended_by_ctrl_c(proc, 120)
        assert "STRUCK" in proc.stdout.read()
    else:
        proc = subprocess.Popen([sys.executable, "-m", "stagewise.cli", "generate", str(folder), "--stages", "3",
                                 "--prompt-ids", "5,6,7", "--max-new-tokens", "480", "--max-model-len", "500"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        children = []
        deadline = time.monotonic() + 120
        while len(children) < 3 and time.monotonic() < deadline:  # the stage processes exist
            children = process_children(proc.pid)
            time.sleep(0.05)
        assert len(children) == 3, "the stage processes did not start"
        os.killpg(proc.pid, signal.SIGINT)
        ended_by_ctrl_c(proc, 30)
    assert gone(children), "stage processes left behind"

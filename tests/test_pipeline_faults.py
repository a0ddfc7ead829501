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
from stagewise.launch.local import spawn_stages, stop_processes
from stagewise.launch.planfile import RunPlan
from stagewise.runtime import links
from stagewise.runtime.driver import PipelineDriver
from stagewise.transport.errors import HandshakeError
from stagewise.transport.frame import Frame, Row, RowFlags, StepKind
from stagewise.transport import encode_frame

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, max_position_embeddings=512)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL)).eval()
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    return path


def _gone(pids, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_dead_or_hung_stage_ends_requests_with_an_error_naming_it(folder, fault):
    from dataclasses import asdict

    from stagewise.runtime.sampling import SamplingParams

    pipe = stagewise.Pipeline(str(folder), stages=3, max_model_len=500, max_num_seqs=4)
    driver = pipe.driver
    pids = [p.pid for p in driver.processes]
    params = asdict(SamplingParams(max_new_tokens=480, temperature=0.0, ignore_eos=True))
    results, struck = {}, None
    try:
        driver.add(0, [5, 6, 7], params)
        driver.add(1, [8, 9], params)
        deadline = time.monotonic() + 120
        while len(results) < 2 and time.monotonic() < deadline:
            for out in driver.pump(0.01):
                results[out["id"]] = out
            # Strike once the first tokens came back: mid-generation, whatever the machine's speed.
            if struck is None and any(s.first_token_s for s in driver.requests.values()):
                os.kill(pids[1], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                struck = time.monotonic()
        ended = time.monotonic()
    finally:
        pipe.close()
    assert struck is not None, "no token came back before the fault"
    assert ended - struck < 5.0
    assert sorted(results) == [0, 1]
    for out in results.values():
        assert out["finish_reason"] == "error" and "stage 1" in out["error"], out["error"]
    assert _gone(pids), "stage processes left behind"
    with pytest.raises(ValueError, match="closed"):
        pipe.generate(prompt_token_ids=[[1, 2]], max_new_tokens=2)


def test_port_in_use_is_a_clear_error(folder, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    plan = RunPlan.build(str(folder), 4, 2).with_stage(0, listen=f"127.0.0.1:{port}")
    path = plan.dump(tmp_path / "plan.json")
    run = subprocess.run([sys.executable, "-m", "stagewise.cli", "stage", "--plan", str(path), "--stage", "0"],
                         capture_output=True, text=True, timeout=120)
    busy.close()
    assert run.returncode == 1
    assert f"127.0.0.1:{port}" in run.stderr and "already in use" in run.stderr, run.stderr


def test_auth_token_and_fingerprint_are_checked(folder):
    from stagewise.model.loader import open_checkpoint

    plan = RunPlan.build(str(folder), 4, 2)
    fingerprint = plan.fingerprint(open_checkpoint(str(folder)).hf_config)
    procs, addresses, _ = spawn_stages(plan, auth_token="right-token")
    try:
        with pytest.raises(HandshakeError, match="auth"):
            PipelineDriver(plan, addresses, fingerprint=fingerprint, auth_token="wrong-token")
        with pytest.raises(HandshakeError, match="auth"):
            PipelineDriver(plan, addresses, fingerprint=fingerprint, auth_token=None)
        with pytest.raises(HandshakeError, match=rf"0123456789abcdef.*{fingerprint}|{fingerprint}.*0123456789abcdef"):
            PipelineDriver(plan, addresses, fingerprint="0123456789abcdef", auth_token="right-token")
        assert all(p.poll() is None for p in procs), "a refused connection must not stop a stage"
        driver = PipelineDriver(plan, addresses, fingerprint=fingerprint, auth_token="right-token")
        driver.add(0, [5, 6, 7], {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True})
        results = []
        while not results:
            results = driver.pump(0.1)
        assert results[0]["finish_reason"] == "length" and len(results[0]["token_ids"]) == 3
        driver.close()
    finally:
        stop_processes(procs, grace_s=5.0)


def test_a_live_stage_rejects_thousands_of_bad_frames_and_serves_on(folder, tmp_path):
    """This test plays the driver and stage 0 (an in-process PipelineHead) against a real last
    stage process. Between valid steps it sends bursts of corrupted, truncated and mismatched
    frames; each is rejected and counted, and the valid steps still give the engine's tokens."""
    import threading

    from stagewise.launch.local import _read_address
    from stagewise.model.loader import load_stage_weights, open_checkpoint
    from stagewise.model.stage import StageModel
    from stagewise.runtime.engine import Engine
    from stagewise.runtime.pipeline_head import PipelineHead
    from stagewise.runtime.sampling import SamplingParams
    from stagewise.runtime.stage_process import step_frame
    from stagewise.runtime.stage_runtime import rows_of

    ckpt = open_checkpoint(str(folder))

    def model(a, b):
        return StageModel.from_weights(ckpt.config, a, b, load_stage_weights(ckpt, a, b, dtype=torch.float32))

    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    engine = Engine(model(0, 4), max_num_seqs=4, max_model_len=64, max_num_tokens=256)
    for rid, p in enumerate(prompts):
        engine.add_request(rid, p, params)
    expected = {}
    while engine.has_unfinished():
        expected.update({o.request_id: o.token_ids for o in engine.step()})

    plan = RunPlan.build(str(folder), 4, 2, max_model_len=64, max_num_tokens=256)
    path = plan.dump(tmp_path / "plan.json")
    proc = subprocess.Popen([sys.executable, "-m", "stagewise.cli", "stage", "--plan", str(path), "--stage", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = _read_address(proc, 1, 120)
        fp = plan.fingerprint(ckpt.hf_config)
        back = links.listen(("127.0.0.1", 0), fingerprint=fp)
        control = links.dial(address, transport="tcp", stage=-1, peer=1, role="driver", fingerprint=fp)
        ready = control.recv(timeout=120).control
        control.send(Frame(step_kind=StepKind.CONTROL, control={
            "op": "setup", "num_blocks": ready["capacity_blocks"], "next": list(back.address), "transport": "tcp"}))
        accepted = {}
        acceptor = threading.Thread(target=lambda: accepted.update(ch=links.accept(back, timeout=60)[0]))
        acceptor.start()
        up = links.dial(address, transport="tcp", stage=0, peer=1, role="activations", fingerprint=fp)
        acceptor.join()
        feedback = accepted["ch"]
        while (control.recv(timeout=60).control or {}).get("op") != "connected":
            pass

        head = PipelineHead(model(0, 2), num_groups=1, num_blocks=ready["capacity_blocks"], max_num_seqs=4,
                            max_model_len=64)
        for rid, p in enumerate(prompts):
            head.add_request(rid, p, params)
        rng, bad_sent, results = random.Random(0), 0, {}
        while head.has_unfinished():
            step, _ = head.launch(0)
            frame = step_frame(rows_of(step.batch), step.hidden_states, group=0, step_id=step.step_id, stage=0,
                               sampling=step.sampling)
            good = encode_frame(frame)
            for _ in range(250):
                up.send_bytes(_mutate(rng, good, frame))
                bad_sent += 1
            up.send(frame)
            reply = feedback.recv(timeout=60)
            assert reply.step_kind == StepKind.TOKENS and reply.step_id == step.step_id
            outs = head.on_tokens(0, reply.step_id, [r.request_id for r in reply.rows],
                                  reply.tensors["token_ids"].tolist())
            results.update({o.request_id: o.token_ids for o in outs})
            freed = head.take_freed()
            if freed:
                up.send(Frame(step_kind=StepKind.CONTROL, stage_from=0, stage_to=1,
                              rows=[Row(r, 0, 0, RowFlags.FINISHED) for r in freed], control={"op": "free"}))
        assert results == expected
        assert bad_sent >= 1000
        control.send(Frame(step_kind=StepKind.CONTROL, control={"op": "stats"}))
        while (stats := control.recv(timeout=30).control or {}).get("op") != "stats":
            pass
        assert stats["rejected_frames"] == bad_sent
        assert proc.poll() is None
        control.send(Frame(step_kind=StepKind.CONTROL, control={"op": "shutdown"}))
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "rejected frame #1 " in err and "bad frame" in err, err[-2000:]
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
from dataclasses import asdict
import stagewise
from stagewise.runtime.sampling import SamplingParams

pipe = stagewise.Pipeline(sys.argv[1], stages=3, max_model_len=500, max_num_seqs=4)
print("PIDS", *[p.pid for p in pipe.driver.processes], flush=True)
try:
    with pipe:
        driver = pipe.driver
        driver.add(0, [5, 6, 7], asdict(SamplingParams(max_new_tokens=480, temperature=0.0, ignore_eos=True)))
        while True:
            driver.pump(0.01)
            if any(s.first_token_s for s in driver.requests.values()):
                print("STRUCK", flush=True)
                os.killpg(0, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
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
        try:
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert "STRUCK" in proc.stdout.read()
    else:
        proc = subprocess.Popen([sys.executable, "-m", "stagewise.cli", "generate", str(folder), "--stages", "3",
                                 "--prompt-ids", "5,6,7", "--max-new-tokens", "480", "--max-model-len", "500"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        children = []
        deadline = time.monotonic() + 120
        while len(children) < 3 and time.monotonic() < deadline:  # the stage processes exist
            children = _children(proc.pid)
            time.sleep(0.05)
        assert len(children) == 3, "the stage processes did not start"
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    err = proc.stderr.read()
    assert code == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert _gone(children), "stage processes left behind"


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out

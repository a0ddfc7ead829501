"""The torch.distributed channel: two spawned processes on a gloo group exchange frames of every
dtype, time out without losing a frame, reject a corrupted frame and carry on, refuse a hello
mismatch on both sides, and report a dead peer as ChannelClosed. Each process writes what it saw
to a JSON file; the assertions run here."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stagewise.transport import ChannelClosed, Frame, FrameError, HandshakeError, Hello, Row, StepKind, encode_frame
from stagewise.transport import torch_dist

HELLO = Hello(fingerprint="tiny/plan", stage_from=0, stage_to=1)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]


def _frames() -> list[Frame]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, dt in enumerate(DTYPES):
        t = (torch.randn(2, 3, 5, generator=g) * 50).to(dt)
        out.append(Frame(step_kind=StepKind.PREFILL, step_id=i, rows=[Row(1, 0, 3), Row(2, 0, 2)],
                         tensors={"hidden": t, "positions": torch.arange(6).reshape(2, 3)}))  # fmt: skip
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    seen: dict = {}
    ch = torch_dist.open_channel(1 - rank, hello=HELLO, auth_token="tok", timeout=30)
    seen["peer"] = ch.peer_name
    if rank == 0:
        for f in _frames():
            ch.send(f)
        t0 = time.monotonic()
        try:
            ch.recv(timeout=0.2)
        except TimeoutError:
            seen["timeout_s"] = time.monotonic() - t0
        ch.send(Frame(step_kind=StepKind.CONTROL, control={"go": 1}))
        seen["after_timeout"] = ch.recv(timeout=30).control
        bad = bytearray(encode_frame(_frames()[0]))
        bad[-3] ^= 0xFF
        ch.send_bytes(bytes(bad))
        ch.send(Frame(step_kind=StepKind.HEARTBEAT, step_id=77))
        ch.send(Frame(step_kind=StepKind.CONTROL, control={"stage": "mismatch"}))
        try:
            torch_dist.open_channel(1, hello=Hello(fingerprint="other", stage_from=0, stage_to=1), tag=1, timeout=30)
        except HandshakeError as e:
            seen["mismatch"] = str(e)
        ch.recv(timeout=30)  # rank 1 says it is about to die
        try:
            ch.recv(timeout=30)
        except ChannelClosed as e:
            seen["closed"] = str(e)
    else:
        got = [ch.recv(timeout=30) for _ in DTYPES]
        seen["equal"] = [torch.equal(g.tensors["hidden"], f.tensors["hidden"]) and g.rows == f.rows
                         for g, f in zip(got, _frames())]  # fmt: skip
        seen["go"] = ch.recv(timeout=30).control
        time.sleep(0.3)
        ch.send(Frame(step_kind=StepKind.CONTROL, control={"late": True}))
        try:
            ch.recv(timeout=30)
        except FrameError as e:
            seen["bad_field"] = e.field
        seen["next"] = ch.recv(timeout=30).step_id
        ch.recv(timeout=30)
        try:
            torch_dist.open_channel(0, hello=HELLO, tag=1, timeout=30)
        except HandshakeError as e:
            seen["mismatch"] = str(e)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(seen, f)
        ch.send(Frame(step_kind=StepKind.CONTROL, control={"dying": True}))
        time.sleep(0.5)
        os._exit(0)  # dies without closing anything
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    os._exit(0)  # the group's peer is gone; skip its teardown


def test_gloo_two_processes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            pytest.fail("a torch.distributed worker hung")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["peer"] == "rank 1 (stage 0 -> 1, role 'activations')"
    assert r1["equal"] == [True] * len(DTYPES) and r1["go"] == {"go": 1}
    assert 0.15 < r0["timeout_s"] < 2 and r0["after_timeout"] == {"late": True}
    assert r1["bad_field"] == "checksum" and r1["next"] == 77
    for r in (r0, r1):
        assert "fingerprint differs" in r["mismatch"] and "'other'" in r["mismatch"] and "'tiny/plan'" in r["mismatch"]
    assert "rank 1" in r0["closed"]

"""TCP channels on loopback: hello and auth, port in use, timeouts, peer death, readiness, and a
fuzz test that feeds thousands of mutated frames to a live receiver between valid ones."""

from __future__ import annotations

import random
import selectors
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from stagewise.transport import (
    ChannelClosed, Frame, FrameError, HandshakeError, Hello, Row, RowFlags, StepKind, encode_frame, tcp,
)  # fmt: skip

HELLO = Hello(fingerprint="smollm2/plan-abc", stage_from=0, stage_to=1, role="activations")


def serve(listener, fn, **accept_kw):
    """Run ``fn(channel)`` on the next accepted connection in a thread; the result (or the
    exception accept/fn raised) lands in ``box``."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(listener.accept(5, **accept_kw))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_round_trip_and_stats():
    with tcp.listen(hello=HELLO) as lis:
        t, box = serve(lis, lambda ch: [ch.recv(5) for _ in range(3)])
        ch = tcp.connect(*lis.address, hello=HELLO, timeout=5)
        assert "listener at 127.0.0.1" in ch.peer_name and "stage 0 -> 1" in ch.peer_name
        frames = [Frame(step_kind=StepKind.DECODE, step_id=i, rows=[Row(7, 10 + i, 1)],
                        tensors={"hidden": torch.randn(1, 1, 16 << (4 * i))}) for i in range(3)]  # fmt: skip
        for f in frames:  # up to 4 MB: the large ones go out with sendmsg from the tensor's memory
            ch.send(f)
        t.join(5)
        got = box["result"]
        for f, g in zip(frames, got):
            assert g.step_id == f.step_id and g.rows == f.rows and torch.equal(g.tensors["hidden"], f.tensors["hidden"])
        assert ch.stats.frames_sent == 3 and ch.stats.bytes_sent == sum(len(encode_frame(f)) for f in frames)
        ch.close()


def handshake_pair(server_hello, client_hello, server_token=None, client_token=None):
    with tcp.listen(hello=server_hello, auth_token=server_token) as lis:
        t, box = serve(lis, lambda ch: ch.peer)
        try:
            ch = tcp.connect(*lis.address, hello=client_hello, auth_token=client_token, timeout=5)
            client = ch.peer
        except HandshakeError as e:
            client = e
        t.join(5)
        return box.get("result", box.get("error")), client


@pytest.mark.parametrize("field,other,shown", [
    ("fingerprint", "smollm2/plan-xyz", ["'smollm2/plan-abc'", "'smollm2/plan-xyz'"]),
    ("stage_to", 2, ["has 1", "has 2"]),
    ("role", "tokens", ["'activations'", "'tokens'"]),
    ("protocol", 1, ["has 2", "has 1"]),  # a version 1 peer
])  # fmt: skip
def test_hello_mismatch_is_refused_on_both_sides_naming_both_values(field, other, shown):
    client_hello = Hello(**{**{k: getattr(HELLO, k) for k in ("fingerprint", "stage_from", "stage_to", "role")}, field: other})
    server, client = handshake_pair(HELLO, client_hello)
    for err in (server, client):
        assert isinstance(err, HandshakeError), err
        msg = str(err)
        assert f"{field} differs" in msg and all(s in msg for s in shown), msg
        assert "listener at 127.0.0.1" in msg and "connector from 127.0.0.1" in msg


def test_listener_wildcards_accept_any_stage_and_role():
    server, client = handshake_pair(Hello(fingerprint=HELLO.fingerprint, stage_from=None, stage_to=None, role=None), HELLO)
    assert server == HELLO and client.stage_from is None


@pytest.mark.parametrize("server_token,client_token,ok", [
    ("s3cret", "s3cret", True), ("s3cret", None, False), ("s3cret", "wrong", False), (None, "s3cret", False),
])  # fmt: skip
def test_auth_token(server_token, client_token, ok):
    server, client = handshake_pair(HELLO, HELLO, server_token, client_token)
    if ok:
        assert server == HELLO and client == HELLO
    else:
        for err in (server, client):
            assert isinstance(err, HandshakeError) and "auth token" in str(err), err


def test_port_in_use_names_host_and_port():
    with tcp.listen(hello=HELLO) as lis:
        host, port = lis.address
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: address already in use"):
            tcp.listen(host, port, hello=HELLO)


def test_connect_retries_while_the_peer_starts_and_timeouts():
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}"):
        tcp.connect("127.0.0.1", port, hello=HELLO, timeout=0.3)
    assert time.monotonic() - t0 < 2
    box = {}

    def late_server():
        time.sleep(0.3)
        with tcp.listen("127.0.0.1", port, hello=HELLO) as lis:
            ch = lis.accept(5)
            box["first"] = ch.recv(5)
            ch.send(Frame(step_kind=StepKind.TOKENS, tensors={"token_ids": torch.arange(5)}))

    t = threading.Thread(target=late_server, daemon=True)
    t.start()
    ch = tcp.connect("127.0.0.1", port, hello=HELLO, timeout=5)  # refused at first, then succeeds
    with pytest.raises(TimeoutError):
        ch.recv(timeout=0.1)  # nothing sent yet
    ch.send(Frame(step_kind=StepKind.HEARTBEAT))
    assert torch.equal(ch.recv(timeout=5).tensors["token_ids"], torch.arange(5))
    t.join(5)
    assert box["first"].step_kind == StepKind.HEARTBEAT
    with tcp.listen(hello=HELLO) as lis, pytest.raises(TimeoutError):
        lis.accept(0.1)


def channel_over_loopback() -> tuple[tcp.TcpChannel, socket.socket]:
    """A channel (without a hello) and the raw socket at its other end, to feed it any bytes."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.create_connection(server.getsockname())
        mine, _ = server.accept()
    return tcp.TcpChannel(mine, local_name="this end", peer_name="raw peer"), theirs


def test_a_record_arriving_in_parts_survives_timeouts():
    ch, raw = channel_over_loopback()
    data = encode_frame(Frame(step_kind=StepKind.TOKENS, tensors={"token_ids": torch.arange(5)}))
    record = tcp.RECORD.pack(tcp.RECORD_MARKER, len(data)) + data
    with ch, raw:
        raw.sendall(record[:5])  # inside the record prefix
        with pytest.raises(TimeoutError):
            ch.recv(timeout=0.1)
        raw.sendall(record[5:40])  # into the frame
        with pytest.raises(TimeoutError):
            ch.recv(timeout=0.1)
        assert ch.poll(0)  # a frame has started to arrive
        raw.sendall(record[40:])
        assert torch.equal(ch.recv(timeout=5).tensors["token_ids"], torch.arange(5))


def test_peer_death_is_channel_closed_promptly_naming_the_peer():
    with tcp.listen(hello=HELLO) as lis:
        code = (f"from stagewise.transport import tcp, Hello; import time\n"
                f"ch = tcp.connect('127.0.0.1', {lis.address[1]}, hello=Hello(fingerprint={HELLO.fingerprint!r}, "
                f"stage_from=0, stage_to=1), timeout=30)\nprint('ready', flush=True)\ntime.sleep(60)\n")  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            ch = lis.accept(60)
            assert proc.stdout.readline().strip() == "ready"
            proc.kill()
            t0 = time.monotonic()
            with pytest.raises(ChannelClosed, match=r"connector from 127\.0\.0\.1:\d+ \(stage 0 -> 1.*EOF"):
                ch.recv(timeout=10)
            assert time.monotonic() - t0 < 2
            with pytest.raises(ChannelClosed):
                ch.send(Frame(step_kind=StepKind.HEARTBEAT))
        finally:
            proc.kill()
            proc.wait()


def test_closing_a_channel_ends_a_send_another_thread_waits_in():
    """A peer that stops reading (a hung stage) fills the socket buffers and the sender waits; the
    sender's own close() from another thread (its heartbeat finding the driver gone) ends that
    wait with ChannelClosed at once."""
    with tcp.listen(hello=HELLO) as lis:
        t, box = serve(lis, lambda ch: ch)
        sender = tcp.connect(*lis.address, hello=HELLO, timeout=5)
        t.join(5)
        idle = box["result"]  # accepted, never read
        frame = Frame(step_kind=StepKind.DECODE, tensors={"hidden": torch.zeros(1 << 18)})  # 1 MiB
        outcome: dict = {}

        def flood():
            try:
                for _ in range(1000):  # far more than the socket buffers hold
                    sender.send(frame)
                outcome["sent"] = True
            except ChannelClosed as err:
                outcome["error"], outcome["at"] = err, time.monotonic()

        th = threading.Thread(target=flood, daemon=True)
        th.start()
        time.sleep(1.0)
        assert th.is_alive() and not outcome  # waiting for the reader that never comes
        closed = time.monotonic()
        sender.close()
        th.join(5)
        assert not th.is_alive() and isinstance(outcome.get("error"), ChannelClosed)
        assert outcome["at"] - closed < 1.0
        idle.close()


def test_selectors_wait_on_several_channels():
    with tcp.listen(hello=HELLO) as lis:
        accepted = []
        t = threading.Thread(target=lambda: accepted.extend(lis.accept(5) for _ in range(2)), daemon=True)
        t.start()
        clients = [tcp.connect(*lis.address, hello=HELLO, timeout=5) for _ in range(2)]
        t.join(5)
        sel = selectors.DefaultSelector()
        for i, ch in enumerate(accepted):
            sel.register(ch, selectors.EVENT_READ, i)
        assert sel.select(0.05) == [] and not accepted[0].poll(0)
        clients[1].send(Frame(step_kind=StepKind.HEARTBEAT, step_id=1))
        ready = sel.select(5)
        assert len(ready) == 1 and accepted[ready[0][0].data].recv(1).step_id == 1
        sel.close()


def test_bad_record_closes_the_stream_and_non_stagewise_peers_are_refused():
    server, client = channel_over_loopback()
    with server, client:
        client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with pytest.raises(FrameError) as err:
            server.recv(5)
        assert err.value.field == "record.marker"
        with pytest.raises(ChannelClosed, match="record.marker"):
            server.recv(5)
    with tcp.listen(hello=HELLO) as lis:
        raw = socket.create_connection(lis.address)  # not our protocol at all
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        with pytest.raises(HandshakeError, match="does not speak this protocol"):
            lis.accept(5)
        raw.close()
        t, box = serve(lis, lambda ch: ch.recv(5).step_id)  # the listener still serves
        tcp.connect(*lis.address, hello=HELLO, timeout=5).send(Frame(step_kind=StepKind.HEARTBEAT, step_id=42))
        t.join(5)
        assert box["result"] == 42


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    how = rng.randrange(5)
    if how == 0:  # truncated
        return bytes(b[: rng.randrange(len(b))])
    if how == 1:  # extended
        return bytes(b) + rng.randbytes(rng.randrange(1, 100))
    if how == 2:  # a header field overwritten
        i = rng.randrange(80)
        b[i] ^= rng.randrange(1, 256)
        return bytes(b)
    if how == 3:  # a spliced frame
        cut = rng.randrange(1, len(b))
        return bytes(b[:cut]) + rng.randbytes(rng.randrange(0, 64))
    for _ in range(rng.randrange(1, 5)):  # flipped bytes anywhere
        i = rng.randrange(len(b))
        b[i] ^= rng.randrange(1, 256)
    return bytes(b)


def _base_frames() -> list[Frame]:
    return [
        Frame(step_kind=StepKind.MIXED, rows=[Row(1, 0, 3, RowFlags.PREFILL), Row(2, 9, 1)],
              tensors={"hidden": torch.randn(1, 4, 8, dtype=torch.bfloat16), "positions": torch.arange(4)}),
        Frame(step_kind=StepKind.TOKENS, rows=[Row(1, 3, 1), Row(2, 10, 1, RowFlags.FINISHED)],
              tensors={"token_ids": torch.tensor([5, 6])}),
        Frame(step_kind=StepKind.CONTROL, control={"op": "add_request", "prompt": [1, 2, 3]}),
        Frame(step_kind=StepKind.KV_HANDOFF, request_id=3, tensors={"k": torch.randn(2, 3, 2, 4), "v": torch.randn(2, 3, 2, 4)}),
    ]  # fmt: skip


@pytest.mark.parametrize("verify", [True, False])
def test_fuzz_live_receiver_keeps_serving_valid_frames(verify):
    rng = random.Random(1234)
    encoded = [encode_frame(f) for f in _base_frames()]
    with tcp.listen(hello=HELLO, verify_checksum=verify) as lis:
        def loop(ch):
            got, bad = [], 0
            while True:
                try:
                    f = ch.recv(10)
                except FrameError:
                    bad += 1
                    continue
                if f.control == {"op": "stop"}:
                    return got, bad
                got.append(f)

        t, box = serve(lis, loop)
        ch = tcp.connect(*lis.address, hello=HELLO, timeout=5)
        sent_valid, mutated = [], 0
        for i in range(3000):
            if i % 5 == 0:
                f = Frame(step_kind=StepKind.DECODE, step_id=i, tensors={"hidden": torch.full((1, 1, 4), float(i))})
                ch.send(f)
                sent_valid.append(i)
            else:
                data = _mutate(rng, rng.choice(encoded))
                ch.send_bytes(data)
                mutated += 1
        ch.send(Frame(step_kind=StepKind.CONTROL, control={"op": "stop"}))
        t.join(60)
        assert "error" not in box, box.get("error")  # only FrameError, never another exception
        got, bad = box["result"]
        valid = [f.step_id for f in got if f.step_kind == StepKind.DECODE and f.tensors.get("hidden") is not None
                 and f.tensors["hidden"].shape == (1, 1, 4) and f.tensors["hidden"][0, 0, 0] == f.step_id]  # fmt: skip
        assert valid == sent_valid  # every valid frame, in order
        if verify:
            assert bad == mutated and len(got) == len(sent_valid)  # every mutation caught by some check
        else:
            assert bad > mutated // 3

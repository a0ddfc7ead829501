"""Mutual TLS on TCP channels, with certificates made here (the ``cryptography`` package): a pair
signed by the run's CA exchanges frames; a peer whose certificate another CA signed, one with no
certificate and one that speaks plain text are refused in the handshake on either side, before
any frame; loopback stays plain unless asked; the listener goes on accepting after a refusal."""

from __future__ import annotations

import socket
import ssl
import threading

import pytest
import torch

pytest.importorskip("cryptography")
from stagewise.bench.transport.certs import make_pki  # noqa: E402
from stagewise.transport import ChannelClosed, Frame, HandshakeError, Hello, Row, StepKind, tcp  # noqa: E402
from stagewise.transport.tls import TlsConfig, is_loopback  # noqa: E402

HELLO = Hello(fingerprint="smollm2/plan-abc", stage_from=0, stage_to=1, role="activations")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls(pki, who: str, ca: str = "ca", loopback: bool = True) -> TlsConfig:
    cert, key = pki[who]
    return TlsConfig(cert=cert, key=key, ca=pki[ca], loopback=loopback)


def _accept(listener, box: dict):
    def run():
        try:
            ch = listener.accept(5)
            box["frame"] = ch.recv(5)
            ch.send(box["frame"])
            box["channel"] = ch
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


FRAME = Frame(step_kind=StepKind.DECODE, step_id=3, rows=[Row(7, 10, 1)], tensors={"hidden": torch.randn(1, 1, 1 << 18)})


def test_a_pair_signed_by_the_runs_ca_exchanges_frames_over_tls(pki):
    with tcp.listen(hello=HELLO, tls=_tls(pki, "stage")) as lis:
        box: dict = {}
        t = _accept(lis, box)
        ch = tcp.connect(*lis.address, hello=HELLO, timeout=5, tls=_tls(pki, "driver"))
        assert isinstance(ch._sock, ssl.SSLSocket) and ch._sock.version() in ("TLSv1.2", "TLSv1.3")
        ch.send(FRAME)  # 1 MB: many TLS records each way
        back = ch.recv(5)
        t.join(5)
        assert "error" not in box, box.get("error")
        assert torch.equal(back.tensors["hidden"], FRAME.tensors["hidden"]) and back.rows == FRAME.rows
        assert box["channel"]._sock.getpeercert()["subject"] == ((("commonName", "driver"),),)
        ch.close()
        box["channel"].close()


@pytest.mark.parametrize("client", ["stranger", "none", "plain"])
def test_a_peer_without_the_runs_ca_is_refused_before_any_frame(pki, client, caplog):
    with tcp.listen(hello=HELLO, tls=_tls(pki, "stage")) as lis:
        refused: dict = {}

        def accept():
            try:
                lis.accept(5)
            except BaseException as e:  # noqa: BLE001
                refused["error"] = e

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        if client == "plain":  # speaks our records, not TLS
            with pytest.raises((HandshakeError, ChannelClosed, OSError)):
                tcp.connect(*lis.address, hello=HELLO, timeout=5)
        elif client == "none":  # TLS, but no certificate
            raw = socket.create_connection(lis.address, timeout=5)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            try:
                with ctx.wrap_socket(raw) as s:
                    s.sendall(b"SWTR" + b"\0" * 60)
                    assert s.recv(1) == b""
            except (ssl.SSLError, OSError):
                pass
        else:
            with pytest.raises((HandshakeError, ChannelClosed)):
                ch = tcp.connect(*lis.address, hello=HELLO, timeout=5, tls=_tls(pki, "stranger", ca="other-ca"))
                ch.recv(2)  # TLS 1.3: the server's refusal of our certificate arrives after our handshake
        t.join(5)
        err = refused["error"]
        assert isinstance(err, HandshakeError) and "TLS with connector from 127.0.0.1" in str(err), err
        # the listener goes on: a good peer still gets in
        box: dict = {}
        t = _accept(lis, box)
        ch = tcp.connect(*lis.address, hello=HELLO, timeout=5, tls=_tls(pki, "driver"))
        ch.send(FRAME)
        assert torch.equal(ch.recv(5).tensors["hidden"], FRAME.tensors["hidden"])
        t.join(5)
        ch.close()


def test_a_tls_client_refuses_a_listener_of_another_ca_or_plain_text(pki):
    with tcp.listen(hello=HELLO, tls=_tls(pki, "stranger", ca="other-ca")) as lis:
        threading.Thread(target=lambda: pytest.raises(Exception, lis.accept, 5), daemon=True).start()
        with pytest.raises(HandshakeError, match="TLS with listener at 127.0.0.1"):
            tcp.connect(*lis.address, hello=HELLO, timeout=5, tls=_tls(pki, "driver"))
    with tcp.listen(hello=HELLO) as lis:  # plain
        threading.Thread(target=lambda: pytest.raises(Exception, lis.accept, 5), daemon=True).start()
        with pytest.raises(HandshakeError, match="does not speak TLS"):
            tcp.connect(*lis.address, hello=HELLO, timeout=5, tls=_tls(pki, "driver"))


def test_loopback_stays_plain_unless_asked(pki):
    plain = _tls(pki, "stage", loopback=False)
    assert not plain.applies("127.0.0.1") and not plain.applies("::1") and not plain.applies("localhost")
    assert plain.applies("10.0.0.2") and plain.applies("node-7")
    assert is_loopback("127.0.0.53") and is_loopback("::ffff:127.0.0.1") and not is_loopback("192.0.2.2")
    assert not is_loopback("::ffff:192.0.2.2")
    with tcp.listen(hello=HELLO, tls=plain) as lis:
        box: dict = {}
        t = _accept(lis, box)
        ch = tcp.connect(*lis.address, hello=HELLO, timeout=5, tls=_tls(pki, "driver", loopback=False))
        assert not isinstance(ch._sock, ssl.SSLSocket)
        ch.send(FRAME)
        ch.recv(5)
        t.join(5)
        ch.close()


def test_tls_config_names_what_is_wrong(pki, tmp_path):
    assert TlsConfig.from_dict(None) is None
    assert TlsConfig.from_dict({"cert": "a", "key": "b", "ca": "c"}) == TlsConfig("a", "b", "c")
    for bad in ({"cert": "a", "key": "b"}, {"cert": "a", "key": "b", "ca": 3}, "x", {"cert": "a", "key": "b", "ca": "c",
                                                                                     "extra": 1}):
        with pytest.raises(ValueError, match="tls"):
            TlsConfig.from_dict(bad)
    missing = TlsConfig(cert=str(tmp_path / "nope.crt"), key=pki["stage"][1], ca=pki["ca"], loopback=True)
    with tcp.listen(hello=HELLO, tls=missing) as lis:
        with pytest.raises(FileNotFoundError, match="tls.cert: no file at"):
            tcp.connect(*lis.address, hello=HELLO, timeout=5, tls=missing)


def test_a_pipeline_over_tls_answers_like_one_process(pki):
    """Every TCP link of a 2-stage pipeline (the driver's controls, the hops) over mutual TLS
    (forced on loopback), tokens as the single process's."""
    from stagewise.api import Pipeline

    question = "What is the capital of France?"
    with Pipeline("smollm2-135m") as one:
        [want] = one.generate([question], chat=True, max_new_tokens=12)
    cert, key = pki["stage"]
    tls = {"cert": cert, "key": key, "ca": pki["ca"], "loopback": True}
    with Pipeline("smollm2-135m", stages=2, transport="tcp", threads=1, tls=tls) as p:
        assert all(isinstance(c._sock, ssl.SSLSocket) for c in p.driver.controls)
        [got] = p.generate([question], chat=True, max_new_tokens=12)
    assert got.token_ids == want.token_ids and "Paris" in got.text


def test_a_torch_hop_between_hosts_is_refused_when_the_plan_asks_for_tls():
    """The torch transport has no TLS: a plan with tls whose hop between hosts would run it is an
    error naming the hop, not activations in plain text; auto resolves to tcp there."""
    from stagewise.parallel.runplan import RunPlan
    from stagewise.pipeline.links import hop_transports

    tls = {"cert": "n.crt", "key": "n.key", "ca": "ca.crt"}
    stages = [{"host": "10.0.0.1", "listen": "10.0.0.1:7000"}, {"host": "10.0.0.2", "listen": "10.0.0.2:7000"}]
    plan = RunPlan.from_dict({"model": "m", "stages": stages, "transport": "torch", "tls": tls}, 4)
    with pytest.raises(ValueError, match=r"hop stage 0 -> 1 crosses hosts \(10.0.0.1 -> 10.0.0.2\) on the torch "
                                         "transport, which has no TLS"):
        hop_transports(plan)
    assert hop_transports(RunPlan.from_dict({"model": "m", "stages": stages, "tls": tls}, 4)) == ["tcp", "tcp"]
    assert hop_transports(RunPlan.from_dict({"model": "m", "stages": stages, "transport": "torch"}, 4)) == [
        "torch", "torch"]

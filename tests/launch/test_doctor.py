"""`stagewise doctor`: real probes (`stagewise stage --probe`) started by the local launcher or by
hand, checked from here. A healthy plan passes every check; a taken port, a model path that one
host cannot read (the probes run in folders of their own, a relative path), a stagewise version
that differs, a host nothing answers on and a doctor without the run's token are each named, with
what to change; nothing is left running."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from stagewise.cli import main
from stagewise.launch.doctor import run_doctor
from stagewise.launch.local import read_address, stage_argv
from stagewise.model.loader import open_checkpoint
from stagewise.parallel.runplan import RunPlan


def _free_ports(n: int) -> list[int]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _plan(model: str, ports: list[int], **extra) -> RunPlan:
    stages = [{"host": "127.0.0.1", "listen": f"127.0.0.1:{p}", "threads": 1} for p in ports]
    return RunPlan.from_dict({"model": model, "partition": "even", "num_layers": 30, "stages": stages, **extra}, 30)


def _write(tmp_path, plan: RunPlan):
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    return str(path)


def _by(checks, what: str) -> list:
    return [c for c in checks if c.what == what]


def test_a_healthy_plan_passes_every_check(tmp_path, capsys):
    path = _write(tmp_path, _plan("smollm2-135m", _free_ports(3)))
    assert main(["doctor", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["model_here"] is None
    whats = [c["what"] for c in out["checks"]]
    for what, count in (("probe started", 3), ("stagewise version", 3), ("model", 3), ("driver -> rank", 3),
                        ("gloo/NCCL interface", 3), ("hop", 3)):
        assert whats.count(what) == count, (what, whats)
    hops = [c["where"] for c in out["checks"] if c["what"] == "hop"]
    assert hops[-1].startswith("stage 2") and "-> stage 0" in hops[-1]
    assert all("rtt" in c["detail"] for c in out["checks"] if c["what"] in ("hop", "driver -> rank"))


def test_a_taken_port_is_named_with_its_stage(tmp_path, capsys):
    ports = _free_ports(2)
    with socket.create_server(("127.0.0.1", ports[1])):  # another program holds stage 1's port
        code = main(["doctor", _write(tmp_path, _plan("smollm2-135m", ports))])
    out = capsys.readouterr().out
    assert code == 1
    line = next(ln for ln in out.splitlines() if ln.startswith("probe started") and "stage 1" in ln)
    assert "FAIL" in line and f"cannot listen on 127.0.0.1:{ports[1]}" in line and "free 127.0.0.1" in line
    assert "not measured" in next(ln for ln in out.splitlines() if ln.startswith("hop"))


def _by_hand(plan: RunPlan, folders) -> list[subprocess.Popen]:
    """The first ``len(folders)`` probes started as a user would on their hosts, each in its own
    folder."""
    procs = []
    for (index, rank), folder in zip(plan.members, folders):
        argv = stage_argv(plan, index, rank=rank, extra=["--probe", "--die-with-parent"])
        procs.append(subprocess.Popen(argv, cwd=folder, stdout=subprocess.PIPE, text=True))
    for p in procs:
        read_address(p, "probe", 60)
    return procs


def test_a_model_path_one_host_cannot_read_is_named(tmp_path, monkeypatch):
    gguf = open_checkpoint("smollm2-135m").path
    good, bad = tmp_path / "host-a", tmp_path / "host-b"
    for folder in (good, bad):
        folder.mkdir()
    (good / "model.gguf").symlink_to(gguf)
    plan = _plan("model.gguf", _free_ports(2))
    monkeypatch.chdir(good)  # the driver's host has the model
    procs = _by_hand(plan, [good, bad])
    try:
        checks, here = run_doctor(plan, None, timeout_s=30)
    finally:
        for p in procs:
            p.kill()
    assert here is None
    models = _by(checks, "model")
    assert [c.ok for c in models] == [True, False]
    assert "stage 1 on 127.0.0.1" in models[1].where and "model.gguf" in models[1].detail
    assert "make 'model.gguf' readable on" in models[1].fix
    assert all(c.ok for c in checks if c.what != "model")


def test_another_stagewise_version_is_named(tmp_path, monkeypatch):
    from stagewise import version

    plan = _plan("smollm2-135m", _free_ports(2))
    monkeypatch.setattr(version, "__version__", "9.9.9")  # this host's: the hosts run the installed one
    checks, _ = run_doctor(plan, "local", timeout_s=60)
    versions = _by(checks, "stagewise version")
    assert len(versions) == 2 and not any(c.ok for c in versions)
    assert "here 9.9.9" in versions[0].detail and versions[0].fix.startswith("install stagewise 9.9.9 on ")


def test_a_host_nothing_answers_on_is_named_and_nothing_is_left(tmp_path):
    plan = _plan("smollm2-135m", _free_ports(2))
    [first] = _by_hand(plan, [tmp_path])  # stage 1's host never started its probe
    checks, _ = run_doctor(plan, None, timeout_s=2)
    started = _by(checks, "probe started")
    assert [c.ok for c in started] == [True, False] and "nothing accepts on 127.0.0.1" in started[1].detail
    assert _by(checks, "hop")[0].detail.startswith("not measured")
    assert first.wait(10) == 0  # told bye, it left


def test_a_probe_measures_towards_the_plans_hosts_only(tmp_path):
    from stagewise.launch.probe import Connection

    plan = _plan("smollm2-135m", _free_ports(2))
    [probe] = _by_hand(plan, [tmp_path])
    with Connection(("127.0.0.1", int(plan.stages[0].listen.rpartition(":")[2]))) as c:
        got = c.ask({"op": "probe", "host": "203.0.113.9", "port": 80})
        assert not got["ok"] and "not a host of the run plan" in got["error"]
        report = c.ask({"op": "report"})
        assert report["fingerprint"] and "_peers" not in report
        assert c.ask({"op": "bye"}) == {"ok": True}
    assert probe.wait(10) == 0


def test_a_probe_answers_only_requests_proven_with_the_runs_token(tmp_path, monkeypatch):
    """A run with a shared secret: its probes refuse a connection that does not prove it (an HMAC
    of the probe's nonce: the secret never crosses the network), and the doctor (which has it)
    checks every host and hop as usual."""
    import hmac
    import json

    from stagewise.launch.probe import Connection

    monkeypatch.setenv("STAGEWISE_AUTH_TOKEN", "s3cret")  # the probes' hosts have it
    plan = _plan("smollm2-135m", _free_ports(2))
    procs = _by_hand(plan, [tmp_path, tmp_path])
    try:
        address = ("127.0.0.1", int(plan.stages[0].listen.rpartition(":")[2]))
        with Connection(address) as c:  # unproven: the first request is refused
            got = c.ask({"op": "report"})
            assert got["ok"] is False and "needs the run's auth token" in got["error"]
            assert c.sock.recv(1) == b""  # and the connection is closed
        with pytest.raises(ValueError, match="needs the run's auth token"):
            Connection(address, "guess")  # another secret
        with socket.create_connection(address, timeout=10) as sock:  # a mac of another nonce does not pass
            f = sock.makefile("rb")
            json.loads(f.readline())
            stale = hmac.new(b"s3cret", b"another nonce", "sha256").hexdigest()
            sock.sendall(json.dumps({"op": "auth", "mac": stale}).encode() + b"\n")
            assert json.loads(f.readline())["ok"] is False
        with Connection(address, "s3cret") as c:
            assert c.ask({"op": "report"})["fingerprint"]
        checks, _ = run_doctor(plan, None, timeout_s=30)  # no token: each probe's check says so
        refused = _by(checks, "auth token")
        assert len(refused) == 2 and not any(c.ok for c in refused)
        assert "needs the run's auth token" in refused[0].detail and "--auth-token" in refused[0].fix
        checks, _ = run_doctor(plan, None, timeout_s=30, auth_token="s3cret")
        assert all(c.ok for c in checks), [c for c in checks if not c.ok]
        assert len(_by(checks, "hop")) == 2  # probe to probe, proven too
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_plan_partly_on_this_machine_probes_it_here_and_prints_the_others(tmp_path, capsys):
    """Stage 0 on this machine (its name, every interface), stage 1 on a host that is not: the
    doctor starts stage 0's probe itself and prints stage 1's command only; stage 1's probe is
    named as not answering, and nothing is left."""
    from helpers.processes import children, gone

    host = socket.gethostname()
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        pytest.skip(f"this machine's name {host!r} does not resolve (the doctor dials stage 0's probe by it)")
    away = "2001:db8::5"  # an IPv6 documentation address: no host answers there
    plan = RunPlan.from_dict({"model": "smollm2-135m", "stages": [
        {"host": host, "listen": "0.0.0.0:0"}, {"host": away, "listen": f"[{away}]:7101"}]}, 30)
    before = set(children(os.getpid()))
    assert main(["doctor", _write(tmp_path, plan), "--timeout", "12"]) == 1  # for both: stage 0 starts in it
    out, err = capsys.readouterr()
    printed = [line for line in err.splitlines() if " stage " in line and not line.startswith("#")]
    assert len(printed) == 1 and printed[0].endswith("--stage 1 --probe"), err
    started = [line for line in out.splitlines() if line.startswith("probe started")]
    assert "stage 0 on" in started[0] and " ok " in started[0], out
    assert "stage 1 on" in started[1] and "FAIL" in started[1] and "nothing accepts" in started[1], out
    assert gone(set(children(os.getpid())) - before, timeout=10)

"""`stagewise serve` as a user runs it: a process serving a 2-stage pipeline over HTTP. Requests from
several clients share the running batches (a short one ends while a long one streams), a client
that goes away frees its request's KV on every stage, the metrics show each stage, a dead stage
turns /health to 503, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from processes import alive, gone  # noqa: E402


def children(pid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if ppid == pid:
                out.append(int(p))
    return out


def metric(page: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(prefix))


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([sys.executable, "-m", "stagewise.cli", "serve", "smollm2-135m", "--stages", "2",
                             "--port", "0", "--max-num-seqs", "4", "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = []
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if " on http://" in line:
                url = line.split(" on ", 1)[1].split()[0].removesuffix("/v1")
        assert url, "the server did not start:\n" + "".join(lines)
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
        with httpx.Client(base_url=url, timeout=60) as client:
            while client.get("/health").status_code != 200:
                time.sleep(0.1)
            yield proc, client
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_short_request_ends_while_a_long_one_streams(server):
    _, client = server
    events = []

    def long():
        with client.stream("POST", "/v1/completions", json={"prompt": "Count:", "max_tokens": 48,
                                                            "ignore_eos": True, "temperature": 0,
                                                            "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(("long", line))
        events.append(("long", "end"))

    t = threading.Thread(target=long)
    t.start()
    while not events:
        time.sleep(0.01)
    short = client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3,
                                                 "temperature": 0})
    events.append(("short", "end"))
    t.join()
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 3
    order = [who for who, what in events if what == "end"]
    assert order == ["short", "long"], "the short request waited for the long one"


def test_a_client_that_goes_away_frees_its_kv(server):
    _, client = server
    before = client.get("/metrics").text
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
                             "ignore_eos": True, "stream": True}) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 3:
                break  # leaving the block closes the connection
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        page = client.get("/metrics").text
        key = 'stagewise_requests_finished_total{finish_reason="cancelled"'
        if metric(page, key) > metric(before, key) and metric(page, "stagewise_kv_blocks_used") == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the request of a client that went away was not cancelled, or its KV not freed:\n" + page)


def test_metrics_show_each_stage(server):
    _, client = server
    client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    page = client.get("/metrics").text
    for stage in ("0", "1"):
        assert f'stagewise_stage_busy_fraction{{model_name="smollm2-135m",stage="{stage}"}}' in page
        assert metric(page, f'stagewise_stage_bytes_sent{{model_name="smollm2-135m",stage="{stage}"}}') > 0


def test_a_dead_stage_turns_health_to_503_and_ctrl_c_leaves_nothing(server):
    proc, client = server
    stages = children(proc.pid)
    assert len(stages) == 2, stages
    os.kill(stages[1], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while client.get("/health").status_code == 200 and time.monotonic() < deadline:
        client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})  # the loop notices on its next poll
        time.sleep(0.1)
    health = client.get("/health")
    assert health.status_code == 503 and "stage 1" in health.json()["reason"], health.text
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and "stage 1" in r.json()["error"]["message"]
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("stagewise serve did not stop on Ctrl-C")
    assert gone(stages) and not alive(proc.pid), "processes left behind"

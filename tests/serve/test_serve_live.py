"""`stagewise serve` as a user runs it: a process serving a 2-stage pipeline over HTTP. Requests from
several clients share the running batches (a short one ends while a long one streams), a client
that goes away frees its request's KV on every stage, the metrics show each stage, a 5 MB prompt
holds up no other request and a body over the limit gets 413 at once, a stage killed mid-answer is
restarted and the answer goes on with the same tokens, a stage that dies or hangs while the server
is idle is replaced at once (/health says so meanwhile), Ctrl-C leaves no process behind, and
without restarts a dead stage turns /health to 503."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from helpers.processes import alive, children, gone  # noqa: E402
from helpers.served import Served  # noqa: E402

from stagewise.pipeline.driver import HEARTBEAT_TIMEOUT_S  # noqa: E402

STAMPED = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} ")


def metric(page: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(prefix))


def reaped(pid: int) -> bool:
    """Whether ``pid`` is gone from the process table (a zombie is not)."""
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture(scope="module")
def server():
    served = Served()
    try:
        yield served
    finally:
        served.stop()


def test_a_short_request_ends_while_a_long_one_streams(server):
    client = server.client
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
    client = server.client
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
    client = server.client
    client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    page = client.get("/metrics").text
    for stage in ("0", "1"):
        assert f'stagewise_stage_busy_fraction{{model_name="smollm2-135m",stage="{stage}"}}' in page
        assert metric(page, f'stagewise_stage_bytes_sent{{model_name="smollm2-135m",stage="{stage}"}}') > 0


def test_a_5_mb_prompt_holds_up_no_other_request(server):
    """The big prompt is tokenised for seconds (and refused: it is longer than the model); probes
    and small completions sent meanwhile take a fraction of that (before they waited for it)."""
    client = server.client
    small = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    assert client.post("/v1/completions", json=small).status_code == 200
    text = ("The quick brown fox jumps over the lazy dog. " * 120_000)[:5_000_000]
    big = {}

    def send_big():
        start = time.perf_counter()
        r = httpx.post(f"{client.base_url}/v1/completions", json={"prompt": text, "max_tokens": 4}, timeout=120)
        big.update(s=time.perf_counter() - start, status=r.status_code, error=r.json()["error"])

    sender = threading.Thread(target=send_big)
    sender.start()
    time.sleep(0.3)  # its body is in: it is being tokenised
    took = []
    while sender.is_alive():
        start = time.perf_counter()
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json=small)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        took.append(time.perf_counter() - start)
        time.sleep(0.25)  # leave the cores to the big one's tokenizer for most of the time
    sender.join()
    assert big["status"] == 400 and big["error"]["code"] == "context_length_exceeded", big
    assert big["error"]["param"] == "prompt", big
    assert len(took) >= 3 and max(took) < big["s"] / 3, \
        f"the small requests took up to {max(took):.2f} s beside a big one of {big['s']:.2f} s ({len(took)} sent)"


def test_a_body_over_the_limit_gets_413_before_it_is_read(server):
    """The default limit (32 MiB), told by the Content-Length or counted as a chunked body streams."""
    from stagewise.serve.openai import MAX_REQUEST_BYTES

    client = server.client
    body = b'{"prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}'
    chunked = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20))
    for content in (body, chunked):
        start = time.perf_counter()
        r = client.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        assert str(MAX_REQUEST_BYTES) in r.json()["error"]["message"]
        assert time.perf_counter() - start < 10
    assert client.get("/health").status_code == 200
    assert metric(client.get("/metrics").text, 'stagewise_requests_rejected_total{model_name="smollm2-135m",'
                  'reason="too_large"}') == 2


def test_the_openai_client(server):
    openai = pytest.importorskip("openai")
    client = server.client
    api = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused")
    [model] = api.models.list().data
    question = [{"role": "user", "content": "What is the capital of France?"}]
    whole = api.chat.completions.create(model=model.id, messages=question, max_tokens=12, temperature=0)
    assert "Paris" in whole.choices[0].message.content and whole.usage.completion_tokens > 0
    stream = api.chat.completions.create(model=model.id, messages=question, max_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    text = api.completions.create(model=model.id, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logprobs=1)
    assert len(text.choices[0].logprobs.token_logprobs) == 5
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.completions.create(model=model.id, prompt="x", temperature=-1)


def test_soak_200_requests_32_at_a_time_a_tenth_cancelled(server):
    """Random lengths, greedy and seeded, every tenth closed mid-stream: the others end with the
    tokens `Pipeline.generate` gives, and every KV block is free at the end."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from stagewise.api import Pipeline

    client = server.client
    rng = random.Random(5)
    words = "the of a river stone light city north quiet green seven over under bright market song".split()
    jobs = []
    for i in range(200):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 24)))
        body = {"prompt": prompt, "max_tokens": rng.randint(1, 24), "ignore_eos": True}
        body.update({"temperature": 0} if i % 2 else {"temperature": 0.8, "top_p": 0.9, "seed": i})
        jobs.append((i, body, i % 10 == 3))

    def run(job):
        i, body, cancel = job
        if not cancel:
            r = client.post("/v1/completions", json=body)
            return i, r.status_code, r.json()
        with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 400, "stream": True}) as r:
            for n, line in enumerate(r.iter_lines()):
                if n == 3:
                    break
        return i, None, None

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, jobs))
    kept = [(i, body) for i, body, cancel in jobs if not cancel]
    with Pipeline("smollm2-135m") as pipe:
        want = pipe.generate([b["prompt"] for _, b in kept], ignore_eos=True, overrides=[
            {k: v for k, v in b.items() if k not in ("prompt", "ignore_eos", "max_tokens")} | {"max_new_tokens": b["max_tokens"]}
            for _, b in kept])
    got = {i: (code, body) for i, code, body in results}
    for (i, _), w in zip(kept, want):
        code, body = got[i]
        assert code == 200, body
        assert body["choices"][0]["text"] == w.text, f"request {i}"
        assert body["usage"]["completion_tokens"] == len(w.token_ids)
    deadline = time.monotonic() + 20
    while metric(client.get("/metrics").text, "stagewise_kv_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.2)
    page = client.get("/metrics").text
    assert metric(page, "stagewise_kv_blocks_used") == 0 and metric(page, "stagewise_requests_running") == 0


def test_a_stage_that_dies_mid_answer_is_restarted_and_the_answer_goes_on(server):
    """Only the dead stage starts again (stage 0 rejoins with its layers loaded)."""
    proc, client = server.proc, server.client
    body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    want = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stages = children(proc.pid)
    chunks = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 5:
                    os.kill(stages[1], signal.SIGKILL)
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert gone(stages[1:]), "the dead stage was not replaced"
    assert client.get("/health").status_code == 200
    assert metric(client.get("/metrics").text, "stagewise_stage_restarts_total") == 1
    new = children(proc.pid)
    assert len(new) == 2 and set(new) & set(stages) == {stages[0]}, "only the dead stage starts again"


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_stage_lost_while_idle_is_replaced_at_once(server, signum):
    """Nothing is running: the server notices the stage within the heartbeat timeout (the dead
    process reaped, /health 503 with the reason) and starts it again before any request comes."""
    proc, client = server.proc, server.client
    stages = children(proc.pid)
    restarts = metric(client.get("/metrics").text, "stagewise_stage_restarts_total")
    os.kill(stages[1], signum)
    lost = time.monotonic()
    health = client.get("/health")
    while health.status_code == 200 and time.monotonic() - lost < HEARTBEAT_TIMEOUT_S + 4:
        time.sleep(0.05)
        health = client.get("/health")
    assert health.status_code == 503, f"still {health.text} {time.monotonic() - lost:.1f} s after the stage was lost"
    assert health.json()["status"] == "repairing" and "stage 1" in health.json()["reason"], health.text
    while health.status_code == 503 and time.monotonic() - lost < 60:
        time.sleep(0.1)
        health = client.get("/health")
    assert health.json() == {"status": "ok"}, health.text
    assert reaped(stages[1]), "the lost stage's process was left behind (a zombie or still running)"
    assert metric(client.get("/metrics").text, "stagewise_stage_restarts_total") == restarts + 1
    r = client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    new = children(proc.pid)
    assert len(new) == 2 and stages[0] in new and all(alive(p) for p in new), "stage 0 rejoins, stage 1 is new"
    said = [line for line in server.log if "starting it again" in line or "the pipeline broke" in line]
    assert len(said) >= 2 and all(STAMPED.match(line) for line in said), said  # the server's and stage 0's


def test_ctrl_c_leaves_nothing(server):
    proc = server.proc
    stages = children(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("stagewise serve did not stop on Ctrl-C")
    assert gone(stages) and not alive(proc.pid), "processes left behind"


def test_without_restarts_a_dead_stage_turns_health_to_503():
    served = Served("--max-restarts", "0")
    try:
        client = served.client
        stages = children(served.proc.pid)
        assert all(STAMPED.match(line) for line in served.log if " on http://" in line), served.log
        os.kill(stages[1], signal.SIGKILL)
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT_S + 4  # noticed with no request sent
        while client.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed", health.text
        assert "stage 1" in health.json()["reason"], health.text
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and "stage 1" in r.json()["error"]["message"]
    finally:
        served.stop()
    assert gone(stages)

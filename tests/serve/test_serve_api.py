"""`stagewise serve`'s HTTP API in one process (the app on Starlette's test client, over the
embedded SmolLM2): the answers are the tokens `Pipeline.generate` gives, whole and streamed, with
OpenAI's bodies; bad requests get 400 and disturb nothing; the API key; back-pressure; metrics."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from stagewise.api import Pipeline  # noqa: E402
from stagewise.serve.app import build_app  # noqa: E402

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def pipe():
    p = Pipeline(MODEL, max_num_seqs=4)
    yield p
    p.close()


@pytest.fixture(scope="module")
def client(pipe):
    with TestClient(build_app(pipe, model_name=MODEL, max_waiting=8)) as c:
        yield c


def sse(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_greedy_is_the_pipelines_answer(client, pipe):
    [want] = pipe.generate([QUESTION[0]["content"]], chat=True, max_new_tokens=12)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 12,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert "Paris" in want.text
    assert choice["finish_reason"] == {"stop": "stop", "length": "length"}[want.finish_reason]
    # The same prompt ran just before: its full blocks (16 tokens each) but the last token's come
    # from the prefix cache.
    n = len(want.prompt_token_ids)
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": len(want.token_ids),
                             "total_tokens": n + len(want.token_ids),
                             "prompt_tokens_details": {"cached_tokens": (n - 1) // 16 * 16}}


def test_completion_logprobs_are_the_pipelines(client, pipe):
    [want] = pipe.generate(["The capital of France is"], max_new_tokens=6, logprobs=2)
    r = client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 6,
                                             "temperature": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["text"] == want.text
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in want.logprobs])
    assert [len(t) for t in lp["top_logprobs"]] == [2] * len(want.token_ids)
    assert "".join(lp["tokens"]) == want.text
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])


def test_seeded_sampling_is_the_pipelines(client, pipe):
    [want] = pipe.generate(["Once upon a time"], max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=7)
    r = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.9,
                                             "top_p": 0.9, "top_k": 40, "seed": 7})
    assert r.json()["choices"][0]["text"] == want.text


def test_streamed_chat_is_the_whole_answer(client):
    whole = client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 12, "temperature": 0,
                                                      "logprobs": True, "top_logprobs": 1}).json()
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": QUESTION, "max_tokens": 12, "temperature": 0, "stream": True,
                             "logprobs": True, "top_logprobs": 1,
                             "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    streamed = [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["logprob"] for e in streamed] == pytest.approx(
        [e["logprob"] for e in whole["choices"][0]["logprobs"]["content"]])
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_stop_strings_end_the_text(client):
    r = client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 20,
                                             "temperature": 0, "stop": ["."]}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and "." not in r["choices"][0]["text"]


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "model": "gpt-4"}, "model"),
    ({"prompt": "x", "logprobs": 9}, "logprobs"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "max_token": 5}, "max_token"),  # misspelt: refused, not ignored
    ({"prompt": "x", "suffix": "!"}, "suffix"),
    ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
])
def test_bad_completion_requests_get_400(client, body, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = client.post("/v1/completions", **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                                {"type": "text", "text": "What is this?"}]}]},
     "messages[0].content[0]"),  # SmolLM2 has no vision tower
    ({"messages": QUESTION, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": QUESTION, "max_tokens": -1}, "max_tokens"),
    ({"messages": QUESTION, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": QUESTION, "max_completion_tokens": 10**6}, "max_completion_tokens"),
    ({"messages": QUESTION, "temprature": 0}, "temprature"),
    ({"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ({"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"},
     "tool_choice"),
    ({"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": QUESTION, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": QUESTION, "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_bad_chat_requests_get_400(client, body, param):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    message = r.json()["error"]["message"]
    other = {"max_tokens": "max_completion_tokens", "max_completion_tokens": "max_tokens"}.get(param)
    assert param in message and (other is None or other not in message), message


def test_unknown_fields_are_named(client):
    r = client.post("/v1/chat/completions", json={"messages": QUESTION, "temprature": 0})
    assert r.json()["error"]["message"] == "Unrecognized request argument supplied: temprature"
    r = client.post("/v1/chat/completions", json={"messages": QUESTION, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0]"
    r = client.post("/v1/chat/completions", json={"messages": QUESTION, "functions": [{"name": "f"}]})
    assert r.json()["error"]["message"] == "'functions' is not supported by this server"


def test_fields_that_ask_for_nothing_more_are_taken(client):
    """OpenAI's fields that change nothing here, null fields, and a feature's 'off' value."""
    r = client.post("/v1/chat/completions", json={
        "messages": QUESTION, "max_completion_tokens": 2, "user": "u-1", "metadata": {"k": "v"}, "store": False,
        "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": None, "seed": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "user": "u-1", "suffix": None})
    assert r.status_code == 200, r.text


def test_the_fields_taken_and_refused_are_the_documented_ones():
    from pathlib import Path

    from stagewise.serve import openai

    doc = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    for name in [*openai.IGNORED_FIELDS, *openai.UNSUPPORTED_FIELDS, *openai.COMPLETION_FIELDS, *openai.CHAT_FIELDS]:
        assert f"`{name}" in doc, f"docs/serving.md does not name the request field {name!r}"


def test_a_body_over_the_limit_gets_413(pipe):
    with TestClient(build_app(pipe, model_name=MODEL, max_request_bytes=1000)) as c:
        fits = json.dumps({"prompt": "Hi " * 300, "max_tokens": 1}).encode()
        over = json.dumps({"prompt": "Hi " * 400, "max_tokens": 1}).encode()
        assert len(fits) <= 1000 < len(over)
        assert c.post("/v1/completions", content=fits).status_code == 200
        for body in (over, iter([over[:600], over[600:]])):  # Content-Length, then chunked
            r = c.post("/v1/completions", content=body)
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "request_too_large" and "1000 bytes" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="max_request_bytes"):
        build_app(pipe, model_name=MODEL, max_request_bytes=0)


def test_a_bad_request_beside_running_ones_disturbs_nothing(client):
    results = {}

    def good(i):
        results[i] = client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8,
                                                           "temperature": 0}).json()

    threads = [threading.Thread(target=good, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    bad = [client.post("/v1/completions", json={"prompt": "x", "top_k": -5}) for _ in range(3)]
    for t in threads:
        t.join()
    assert all(b.status_code == 400 for b in bad)
    texts = {results[i]["choices"][0]["text"] for i in range(3)}
    assert len(texts) == 1 and "Paris" in texts.pop()


def test_models_and_health(client, pipe):
    assert client.get("/health").json() == {"status": "ok"}
    [m] = client.get("/v1/models").json()["data"]
    assert m["id"] == MODEL and m["max_model_len"] == pipe.max_model_len


def test_metrics_count_what_was_served(client):
    before = client.get("/metrics").text
    client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    text = client.get("/metrics").text

    def value(page: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(name))

    assert value(text, "stagewise_generation_tokens_total") - value(before, "stagewise_generation_tokens_total") == 3
    assert value(text, 'stagewise_requests_finished_total{finish_reason="length"') - \
        value(before, 'stagewise_requests_finished_total{finish_reason="length"') == 1
    for name in ("stagewise_time_to_first_token_seconds_count", "stagewise_e2e_request_latency_seconds_count",
                 "stagewise_kv_blocks_free", "stagewise_requests_running"):
        assert name in text


def test_a_repeated_prompt_is_cached_until_the_cache_is_reset(pipe):
    """A prompt sent twice: the second answer's usage counts its cached tokens, and so do the
    metrics; after POST /v1/reset_prefix_cache (behind the API key) nothing is found cached."""
    prompt = "The history of the city begins with a small market by the river, " * 4

    def value(page: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(name))

    key = {"Authorization": "Bearer sekrit"}
    with TestClient(build_app(pipe, model_name=MODEL, api_key="sekrit")) as c:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        cached = [c.post("/v1/completions", json=body, headers=key).json()["usage"]["prompt_tokens_details"]
                  ["cached_tokens"] for _ in range(2)]
        page = c.get("/metrics").text
        assert c.post("/v1/reset_prefix_cache").status_code == 401
        assert c.post("/v1/reset_prefix_cache", headers=key).json() == {"status": "ok"}
        after = c.post("/v1/completions", json=body, headers=key).json()["usage"]
    n = after["prompt_tokens"]
    assert cached[1] == (n - 1) // 16 * 16 > 0 and after["prompt_tokens_details"]["cached_tokens"] == 0
    assert value(page, "stagewise_prefix_cache_hit_tokens_total") >= cached[1]
    assert value(page, "stagewise_prefix_cache_blocks") >= n // 16


def test_api_key(pipe):
    with TestClient(build_app(pipe, model_name=MODEL, api_key="sekrit")) as c:
        body = {"prompt": "Hi", "max_tokens": 2}
        assert c.post("/v1/completions", json=body).status_code == 401
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert c.get("/health").status_code == 200  # health and metrics stay open to probes


def test_past_the_queue_503_with_retry_after(pipe):
    # One running place and none waiting (max_num_seqs is 4: max_waiting=-3 is not allowed, so
    # hold four long requests first).
    with TestClient(build_app(pipe, model_name=MODEL, max_waiting=0)) as c:
        started = threading.Barrier(5)
        codes = []

        def long():
            started.wait()
            codes.append(c.post("/v1/completions", json={"prompt": "Count:", "max_tokens": 40, "ignore_eos": True,
                                                          "temperature": 0}).status_code)

        threads = [threading.Thread(target=long) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait()
        loop = c.app.state.serving["loop"]
        while loop.held < 4:
            threading.Event().wait(0.01)
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        for t in threads:
            t.join()
    assert r.status_code == 503 and r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "busy"
    assert codes == [200] * 4

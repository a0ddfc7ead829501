"""Structured output and tool calls through the official `openai` client against `stagewise serve`
(SmolLM2, as one process and as 2 stages): `chat.completions.parse` with a pydantic model, tool
calls forced by `tool_choice` (plain and streamed), a tool's result fed back, vLLM's guided
fields, a schema that cannot be compiled (400), and a stage killed in the middle of a constrained
answer."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
from typing import Annotated, Literal

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from helpers.processes import children, gone  # noqa: E402
from helpers.served import Served  # noqa: E402


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false

    kind: Literal["cat", "dog", "bird"]
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=30)
    toys: list[Annotated[str, pydantic.StringConstraints(max_length=12)]] = pydantic.Field(max_length=2)


class Owner(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false

    name: str = pydantic.Field(max_length=16)
    height_m: float = pydantic.Field(ge=0.5, le=2.5)
    pets: list[Pet] = pydantic.Field(max_length=2)


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false

    city: str = pydantic.Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                            "parameters": Weather.model_json_schema()}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {
                                             "type": "string", "maxLength": 20}}, "required": ["city"]}}}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Rome", "Quito", "Perth", "Dakar", "Hanoi"] * 2


@pytest.fixture(scope="module", params=[1, 2], ids=["1-stage", "2-stages"])
def served(request):
    server = Served("--stages", str(request.param))
    try:
        api = openai.OpenAI(base_url=str(server.client.base_url) + "/v1", api_key="unused", max_retries=0)
        yield server, api, request.param
    finally:
        server.stop()


def many(fn, n: int = 20) -> list:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))


def test_parse_gives_a_pydantic_object_20_of_20(served):
    _, api, _ = served

    def ask(i):
        return api.chat.completions.parse(
            model="smollm2-135m", response_format=Owner, max_tokens=200, temperature=0.7, seed=i,
            messages=[{"role": "user", "content": f"Describe pet owner number {i} from {CITIES[i]} as JSON."}])

    for out in many(ask):
        assert out.choices[0].finish_reason == "stop", out
        assert isinstance(out.choices[0].message.parsed, Owner)


def test_a_forced_tool_call_has_valid_arguments_20_of_20_plain_and_streamed(served):
    _, api, _ = served

    def ask(i):
        messages = [{"role": "user", "content": f"What is the weather like in {CITIES[i % len(CITIES)]}?"}]
        if i % 2:
            out = api.chat.completions.create(model="smollm2-135m", messages=messages, tools=[WEATHER, TIME],
                                              tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                                              temperature=0.8, seed=i)
            assert out.choices[0].finish_reason == "tool_calls", out.choices[0].message.content
            return out.choices[0].message.tool_calls
        stream = api.chat.completions.create(
            model="smollm2-135m", messages=messages, tools=[WEATHER, TIME], stream=True, max_tokens=80, seed=i,
            temperature=0.8, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        calls, finish = {}, None
        for chunk in stream:
            for d in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        return [type("Call", (), {"function": type("F", (), c)}) for c in calls.values()]

    for calls in many(ask, 40):
        assert calls
        for call in calls:
            if call.function.name == "get_weather":
                Weather.model_validate_json(call.function.arguments)
            else:
                assert call.function.name == "get_time" and "city" in json.loads(call.function.arguments)


def test_a_tool_result_fed_back_gives_an_answer(served):
    _, api, _ = served
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    first = api.chat.completions.create(model="smollm2-135m", messages=messages, tools=[WEATHER],
                                        tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                        temperature=0)
    [call] = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    final = api.chat.completions.create(model="smollm2-135m", messages=messages, tools=[WEATHER], tool_choice="none",
                                        max_tokens=60, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_guided_regex_and_choice_and_structured_outputs(served):
    _, api, _ = served
    ask = [{"role": "user", "content": "Give me a time of day."}]
    out = api.chat.completions.create(model="smollm2-135m", messages=ask, max_tokens=12,
                                      extra_body={"guided_regex": r"([01]\d|2[0-3]):[0-5]\d"})
    assert re.fullmatch(r"([01]\d|2[0-3]):[0-5]\d", out.choices[0].message.content)
    out = api.completions.create(model="smollm2-135m", prompt="The sky is", max_tokens=5,
                                 extra_body={"guided_choice": ["blue", "green"]})
    assert out.choices[0].text in ("blue", "green")
    out = api.chat.completions.create(model="smollm2-135m", messages=ask, max_tokens=8,
                                      extra_body={"structured_outputs": {"choice": ["morning", "night"]}})
    assert out.choices[0].message.content in ("morning", "night")
    out = api.chat.completions.create(model="smollm2-135m", messages=ask, max_tokens=120, temperature=0,
                                      response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].message.content), dict)


def test_a_schema_that_cannot_be_compiled_gets_400(served):
    _, api, _ = served
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/definitions/missing"}}}}}
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        api.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "x"}],
                                    response_format=bad)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        api.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                                    tool_choice={"type": "function", "function": {"name": "nope"}})


@pytest.mark.parametrize("served", [2], indirect=True, ids=["2-stages"])
def test_a_stage_killed_mid_answer_leaves_the_answer_valid(served):
    server, api, stages = served
    body = {"messages": [{"role": "user", "content": "Describe a pet owner as JSON."}], "max_tokens": 200,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "owner", "schema": Owner.model_json_schema()}}}
    want = server.client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    Owner.model_validate_json(want)
    stages_before = children(server.proc.pid)
    text = ""
    with server.client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for n, line in enumerate(line for line in r.iter_lines() if line.startswith("data: {")):
            text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if n == 8:
                os.kill(stages_before[1], signal.SIGKILL)
    assert text == want
    assert gone(stages_before[1:])

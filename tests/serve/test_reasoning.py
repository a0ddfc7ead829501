"""A reasoning model's thinking apart from its answer (``serve --reasoning-parser``): the split of
an output into thinking and answer by what its prompt did with the tags, the same streamed in any
pieces as whole; and through the official `openai` client against `stagewise serve` with a
thinking chat template: thinking on, the output is free thinking (the constraint waits for
``</think>``), the same tokens as without the constraint; thinking off (``chat_template_kwargs``),
the constraint holds from the first token."""

from __future__ import annotations

import json

import pytest

from stagewise.serve.reasoning import ReasoningStream, reasoning_for, split

OPEN, CLOSED, NEITHER = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n", \
    "<|im_start|>assistant\n"


@pytest.mark.parametrize("prompt, output, want", [
    (NEITHER, "<think>\nLet me see.\n</think>\n\nIt is 4.", ("Let me see.\n", "It is 4.")),
    (NEITHER, "It is 4.", (None, "It is 4.")),
    (NEITHER, "  It <think> is", (None, "  It <think> is")),
    (NEITHER, "<think>cut off while thinking", ("cut off while thinking", "")),
    (NEITHER, "<thi", (None, "<thi")),
    (OPEN, "Let me see.\n</think>\n\nIt is 4.", ("Let me see.\n", "It is 4.")),
    (OPEN, "no end </thin", ("no end </thin", "")),
    (CLOSED, "\n</think> It is 4.", (None, "\n</think> It is 4.")),
])
def test_an_output_splits_the_same_whole_and_streamed_in_any_pieces(prompt, output, want):
    r = reasoning_for("qwen3", prompt)
    assert split(r, output) == want
    for i in range(len(output) + 1):
        for j in range(i, len(output) + 1):
            stream = ReasoningStream(r)
            parts = [stream.feed(output[:i]), stream.feed(output[i:j]), stream.feed(output[j:]), stream.finish()]
            got = ("".join(p[0] for p in parts) if stream.thought else None, "".join(p[1] for p in parts))
            assert got == want, (i, j)


def test_the_constraint_waits_unless_the_prompt_closed_the_thinking():
    assert reasoning_for("qwen3", OPEN).constraint_after == "</think>"
    assert reasoning_for("deepseek_r1", NEITHER).constraint_after == "</think>"
    assert reasoning_for("qwen3", CLOSED).constraint_after is None


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
            "{% else %}<think>\n{% endif %}{% endif %}")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("llguidance")
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    from helpers.served import Served

    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(TEMPLATE)
    server = Served("--stages", "1", "--chat-template", str(template), "--reasoning-parser", "qwen3")
    try:
        yield server, openai.OpenAI(base_url=str(server.client.base_url) + "/v1", api_key="unused", max_retries=0)
    finally:
        server.stop()


def test_thinking_is_free_and_goes_to_reasoning_content(served):
    server, api = served
    ask = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 24,
           "temperature": 0}
    free = api.chat.completions.create(**ask).choices[0]
    held = api.chat.completions.create(**ask, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}).choices[0]
    # The model never ends its thinking here: the schema never holds, and the tokens are the free run's.
    assert free.finish_reason == held.finish_reason
    assert held.message.reasoning_content == free.message.reasoning_content and held.message.reasoning_content
    assert held.message.content == free.message.content == ""
    stream = api.chat.completions.create(**ask, stream=True)
    thinking = content = ""
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        thinking += getattr(delta, "reasoning_content", None) or ""
        content += (delta.content or "") if delta is not None else ""
    assert (thinking, content) == (free.message.reasoning_content, "")


def test_thinking_off_the_constraint_holds_from_the_first_token(served):
    server, api = served
    out = api.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "What is 2 + 2? Answer in JSON."}],
        max_tokens=40, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}).choices[0]
    assert out.finish_reason == "stop" and out.message.reasoning_content is None
    assert set(json.loads(out.message.content)) == {"answer"}
    bad = server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"

"""Tool calls parsed from a model's output, whole and streamed: each family's format (hermes'
``<tool_call>``, Llama 3's ``<|python_tag|>`` with ``;`` between calls, the generic object), a call
forced by ``tool_choice`` (required: an array; named: the arguments), arguments written before the
name or as a JSON string, and outputs that hold no call. Streamed, for every cut of the text and
character by character, a call goes out as it is written (its name, then its arguments in pieces)
and adds up to what the whole answer holds."""

from __future__ import annotations

import json

import pytest

from stagewise.serve.tool_stream import ToolStream
from stagewise.serve.tools import ToolCalling

TOOLS = ({"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
         {"name": "get_time", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}})
WEATHER, TIME = {"city": "Oslo"}, {"city": 'Paris, "FR" {x}'}


def calling(choice: str, family: str = "generic", named: str | None = None) -> ToolCalling:
    return ToolCalling(TOOLS, choice, named, True, family)


CASES = {
    "named": (calling("named", named="get_weather"), ' {"city": "Oslo"}  ', "", [("get_weather", WEATHER)]),
    "required": (calling("required"), '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                                      '{"name":"get_time","arguments":{"city":"Paris, \\"FR\\" {x}"}}]',
                 "", [("get_weather", WEATHER), ("get_time", TIME)]),
    "hermes": (calling("auto", "hermes"), 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                          '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"arguments": {"city": '
                                          '"Paris, \\"FR\\" {x}"}, "name": "get_time"}\n</tool_call>',
               "Let me look.", [("get_weather", WEATHER), ("get_time", TIME)]),
    "llama3": (calling("auto", "llama3"), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                          '{"name": "get_time", "parameters": {"city": "Paris, \\"FR\\" {x}"}}',
               "", [("get_weather", WEATHER), ("get_time", TIME)]),
    "generic-quoted": (calling("auto"), '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}', "",
                       [("get_weather", WEATHER)]),
    "no-call": (calling("auto", "hermes"), "It is sunny in <b>Oslo</b>.", "It is sunny in <b>Oslo</b>.", []),
    "not-a-call": (calling("auto"), '{"answer": 42}', '{"answer": 42}', []),
    "unknown-tool": (calling("auto", "hermes"), '<tool_call>{"name": "book", "arguments": {}}</tool_call>',
                     '<tool_call>{"name": "book", "arguments": {}}</tool_call>', []),
}


def stream(calling: ToolCalling, pieces: list[str]) -> tuple[str, list[dict], dict[int, int]]:
    """The content and the calls a client puts together, and per call how many argument pieces came
    before the output ended."""
    s, content, calls, early = ToolStream(calling), "", {}, {}

    def take(items, before_end):
        for d in items:
            call = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in d:
                assert call["id"] is None and d["type"] == "function"  # an id once, with the first piece
                call["id"] = d["id"]
            call["name"] += d["function"].get("name", "")
            call["arguments"] += d["function"].get("arguments", "")
            early[d["index"]] = early.get(d["index"], 0) + (before_end and bool(d["function"].get("arguments")))

    for p in pieces[:-1]:
        text, items = s.feed(p)
        content += text
        take(items, True)
    text, items = s.end(pieces[-1])  # the last text and the end in one chunk: each call in it once
    assert len({d["index"] for d in items}) == len(items)
    take(items, False)
    assert s.called == bool(calls) or not s.called
    return content + text, [calls[i] for i in sorted(calls)], early


@pytest.mark.parametrize("case", CASES)
def test_calls_whole_and_streamed(case):
    calling, text, content, want = CASES[case]
    whole_content, whole = calling.parse(text)
    assert (whole_content or "").strip() == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == want
    for cut in range(len(text) + 1):
        got_content, got, _ = stream(calling, [text[:cut], text[cut:]])
        assert got_content.strip() == content, cut
        assert [(c["name"], c["arguments"]) for c in got] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole], cut
        assert all(c["id"] and c["id"].startswith("call_") for c in got)
    _, got, early = stream(calling, [*text, ""])
    assert [(c["name"], c["arguments"]) for c in got] == [(c["function"]["name"], c["function"]["arguments"])
                                                           for c in whole]
    for i in range(len(want)):
        # A JSON string's text is known once the string ends; hermes' second call writes its
        # arguments before its name, which they wait for.
        whole_at_once = case == "generic-quoted" or (case, i) == ("hermes", 1)
        assert early[i] >= (1 if whole_at_once else 3), (i, early)  # sent as they were written


def test_a_call_cut_off_keeps_what_was_written():
    """An answer cut off by max_tokens in a call's arguments: the stream has sent its beginning, and
    nothing is sent twice or taken back as content."""
    calling = CASES["required"][0]
    text = '[{"name": "get_weather", "arguments": {"city": "Os'
    content, [call], early = stream(calling, [*text, ""])
    assert content == "" and call["name"] == "get_weather" and call["arguments"] == '{"city": "Os'

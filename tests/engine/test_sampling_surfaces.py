"""SamplingParams is the one definition of a sampling option: each field reaches the command line,
``Pipeline.generate``, a run plan's ``sampling:`` section, a prompt file's lines and both OpenAI
endpoints under the names :data:`SURFACES` gives it, with the field's default and its check. A
new field that one surface does not take fails here."""

from __future__ import annotations

import argparse
import inspect
import json

import pytest

from stagewise.engine.params import CONSTRAINTS, SAMPLING_FIELDS, SURFACES, SamplingParams, defaults, options


COMMON = {"max_new_tokens": 7, "temperature": 0.5, "top_k": 3, "top_p": 0.9, "min_p": 0.05,
          "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 11,
          "stop": ["##", "END"], "stop_token_ids": [4, 9], "ignore_eos": True, "logprobs": 2,
          "max_draft_tokens": 2}
CONSTRAINED = {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}, "regex": "[a-z]+",
               "grammar": 'root ::= "x"', "choice": ["yes", "no"]}
WITH_CONSTRAINT = {"constraint_after": "</think>"}
"""A value other than the default for every field; at most one constraint a request: each test
takes the others' values with each constraint in turn (and the fields that need one)."""


@pytest.fixture(params=list(CONSTRAINTS))
def examples(request) -> dict:
    return {**COMMON, **WITH_CONSTRAINT, request.param: CONSTRAINED[request.param]}


def test_every_field_has_an_example_other_than_its_default(examples):
    examples_given = set(COMMON) | set(CONSTRAINED) | set(WITH_CONSTRAINT)
    assert examples_given == set(SAMPLING_FIELDS), "give the new field an example here"
    given = SamplingParams(**examples)
    assert all(getattr(given, name) != default for name, default in defaults().items() if name in examples)


def _argv(row, examples, tmp_path) -> list[str]:
    if row.field not in examples:
        return []
    value = examples[row.field]
    if value is True:
        return [row.flag]
    if row.field == "stop_token_ids":
        return [row.flag, ",".join(map(str, value))]
    if options()[row.field].file:
        path = tmp_path / row.field
        path.write_text(value if isinstance(value, str) else json.dumps(value))
        return [row.flag, str(path)]
    if isinstance(value, list):
        return [a for v in value for a in (row.flag, v)]
    return [row.flag, str(value)]


@pytest.mark.parametrize("command", ["generate", "launch"])
def test_the_command_line_has_one_flag_per_field(command, tmp_path, examples):
    from stagewise.cli import build_parser
    from stagewise.cli.sampling import sampling_args

    parser = build_parser()[1][command]
    [group] = [g for g in parser._action_groups if g.title == "sampling"]
    assert [a.option_strings for a in group._group_actions] == [[row.flag] for row in SURFACES]
    args = parser.parse_args(["m", *[a for row in SURFACES for a in _argv(row, examples, tmp_path)]])
    assert sampling_args(args) == examples
    nothing = parser.parse_args(["m"])
    assert sampling_args(nothing) == {} and sampling_args(nothing, {"top_k": 5}) == {"top_k": 5}
    assert sampling_args(parser.parse_args(["m", "--top-k", "2"]), {"top_k": 5, "seed": 1}) == {"top_k": 2, "seed": 1}


def test_a_prompt_file_line_takes_every_field(tmp_path, examples):
    from stagewise.cli.prompt_args import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1, 2], **examples}) + "\n")
    problems: list[str] = []
    batch = read_prompts(argparse.Namespace(prompt=[], prompt_ids=[], prompt_file=str(path), chat=False), problems)
    assert problems == [] and batch.overrides == [examples]


def test_pipeline_generate_takes_every_field_as_a_keyword_with_its_default(examples):
    from stagewise.api import Pipeline
    from stagewise.frontend.run import sampling_per_prompt

    keywords = {name: p.default for name, p in inspect.signature(Pipeline.generate).parameters.items()
                if p.kind is p.KEYWORD_ONLY and name in SAMPLING_FIELDS}
    assert keywords == defaults()
    [params] = sampling_per_prompt(examples, 1, None)
    assert {name: getattr(params, name) for name in examples} == examples
    with pytest.raises(ValueError, match="'temprature' is not a sampling option .did you mean 'temperature'"):
        sampling_per_prompt({"temprature": 1.0}, 1, None)


def test_a_run_plan_takes_every_field(examples):
    from stagewise.parallel.plan_options import option_problems

    assert option_problems({"sampling": examples}) == []
    assert option_problems({"sampling": {"top_k": -1, "topk": 3}}) == [
        "sampling.top_k must be an int >= 0 (0 = off), got -1",
        "sampling: 'topk' is not a sampling option (did you mean 'top_k'?)"]


def _openai_body(chat: bool, examples: dict) -> dict:
    body = {}
    for row in SURFACES:
        names = row.openai + (row.openai_chat if chat else ())
        if row.field in examples:
            body[names[-1]] = examples[row.field]
    if chat:  # the chat endpoint's logprobs: a flag, and top_logprobs the count
        body["logprobs"] = True
    return body


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_both_openai_endpoints_take_every_field(chat, examples):
    from stagewise.serve import openai

    body = _openai_body(chat, examples)
    if chat:
        req = openai.parse_chat({**body, "messages": [{"role": "user", "content": "hi"}]}, "m",
                                lambda messages, tools, template_kwargs: "hi", 16)
    else:
        req = openai.parse_completion({**body, "prompt": "hi"}, "m", 16)
    assert {name: getattr(req.params, name) for name in examples} == examples
    fields = openai.CHAT_FIELDS if chat else openai.COMPLETION_FIELDS
    assert {name for row in SURFACES for name in row.openai} <= fields


def test_openai_defaults_differ_only_where_openai_says_so():
    from stagewise.serve import openai

    req = openai.parse_completion({"prompt": "hi"}, "m", default_max=33)
    given = {name: getattr(req.params, name) for name in SAMPLING_FIELDS}
    assert given == {**defaults(), "max_new_tokens": 33, **openai.OPENAI_DEFAULTS}

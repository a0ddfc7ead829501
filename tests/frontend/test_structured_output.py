"""Structured output through `Pipeline.generate` on the real SmolLM2: each kind of constraint gives
output that holds (a pydantic model validates the JSON), a constraint that does not bind leaves
the tokens and logprobs of the free run, free requests beside constrained ones are untouched, a
resumed request's constraint goes on from the tokens it had, a pipeline of 2 stages gives the
tokens of one process, and a constraint that cannot run is refused before anything runs."""

from __future__ import annotations

import re
from typing import Literal

import pytest

pytest.importorskip("llguidance")
pydantic = pytest.importorskip("pydantic")

from stagewise.api import Pipeline  # noqa: E402
from stagewise.engine.params import SamplingParams  # noqa: E402


class Address(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false

    city: str = pydantic.Field(max_length=16)
    zip: str = pydantic.Field(pattern=r"^\d{5}$")


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false

    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    scores: list[int] = pydantic.Field(max_length=3)
    address: Address


PROMPTS = ["Describe a person who lives in Paris as JSON.", "Invent a user of a website, as JSON.",
           "Give me a JSON record for a guest named Ann."]


@pytest.fixture(scope="module")
def pipe():
    p = Pipeline("smollm2-135m", max_num_seqs=8)
    yield p
    p.close()


def test_json_schema_regex_choice_and_grammars_hold(pipe):
    outs = pipe.generate(PROMPTS, chat=True, max_new_tokens=120, json_schema=Person.model_json_schema())
    for out in outs:
        assert out.finish_reason == "stop", out
        Person.model_validate_json(out.text)
    [date] = pipe.generate(["When was the moon landing?"], chat=True, regex=r"\d{4}-\d{2}-\d{2}", max_new_tokens=16)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.text), date.text
    [pick] = pipe.generate(["Is fire hot?"], chat=True, choice=["yes", "no", "maybe"], max_new_tokens=8)
    assert pick.text in ("yes", "no", "maybe")
    gbnf = 'root ::= "The answer is " ("one" | "two") "."'
    lark = 'start: "Count: " DIGIT ("," DIGIT)*\n%import common.DIGIT'
    [a, b] = pipe.generate(["Pick a number."] * 2, chat=True, max_new_tokens=20,
                           overrides=[{"grammar": gbnf}, {"grammar": lark}])
    assert a.text in ("The answer is one.", "The answer is two."), a.text
    assert re.fullmatch(r"Count: \d(,\d)*", b.text), b.text


def test_a_constraint_that_does_not_bind_changes_nothing(pipe):
    """The free greedy answer, then the same prompt held to a regex that answer already matches:
    the same tokens and logprobs; free prompts beside a constrained one get their own tokens."""
    [free] = pipe.generate(["What is the capital of France?"], chat=True, max_new_tokens=24, logprobs=2)
    assert free.finish_reason == "stop"
    [held] = pipe.generate(["What is the capital of France?"], chat=True, max_new_tokens=24, logprobs=2,
                           regex=re.escape(free.text) + r"( and more)?")
    assert held.token_ids == free.token_ids and held.text == free.text
    for a, b in zip(held.logprobs, free.logprobs):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-5
    alone = pipe.generate(["Name a colour.", "Say hello."], chat=True, max_new_tokens=12)
    mixed = pipe.generate(["Name a colour.", "Is ice cold?", "Say hello."], chat=True, max_new_tokens=12,
                          overrides=[None, {"choice": ["yes", "no"]}, None])
    assert [m.token_ids for m in (mixed[0], mixed[2])] == [a.token_ids for a in alone]
    assert mixed[1].text in ("yes", "no")


def test_constraint_after_leaves_the_output_free_until_its_text(pipe):
    """A text from the free greedy answer stands for a reasoning model's ``</think>``: up to the
    token that completes it, the held run's tokens are the free run's; after it, the choice holds
    (the free answer goes on with something else). A resumed request past the text goes on held."""
    [free] = pipe.generate(["Tell me about Paris."], chat=True, max_new_tokens=16)
    tokenizer = pipe.tokenizer
    ids = free.token_ids
    k = next(k for k in range(3, len(ids)) if tokenizer.decode(ids[:k]).endswith(tokenizer.decode(ids[k - 2:k]))
             and tokenizer.decode(ids[k - 2:k]).strip() and tokenizer.decode(ids[k - 2:k])
             not in tokenizer.decode(ids[:k - 1]))
    marker = tokenizer.decode(ids[k - 2:k])  # its first occurrence ends with token k - 1
    [held] = pipe.generate(["Tell me about Paris."], chat=True, max_new_tokens=16, choice=["yes", "no"],
                           constraint_after=marker)
    assert held.token_ids[:k] == ids[:k] and held.finish_reason == "stop"
    assert tokenizer.decode(held.token_ids[k:]) in ("yes", "no") and tokenizer.decode(ids[k:]) not in ("yes", "no")


def test_masks_computed_beside_the_forward_or_after_it_give_the_same_tokens(pipe, monkeypatch):
    """With a core torch leaves free the masks are computed while the forward runs; without, after
    it: the same tokens either way (and the first way is taken when it should be)."""
    import torch

    import stagewise.engine.step_sampling as step_sampling
    from stagewise.launch.local import usable_cores

    if usable_cores() < 2:
        pytest.skip("needs 2 cores: one for torch, one for the masks")
    calls = []
    real = step_sampling.masks_ahead
    monkeypatch.setattr(step_sampling, "masks_ahead", lambda *a: calls.append(1) or real(*a))
    before = torch.get_num_threads()
    outs = {}
    try:
        for threads in (1, usable_cores()):
            torch.set_num_threads(threads)
            calls.clear()
            outs[threads] = pipe.generate(PROMPTS[:2], chat=True, max_new_tokens=40,
                                          json_schema=Person.model_json_schema())
            assert bool(calls) == (threads < usable_cores())
    finally:
        torch.set_num_threads(before)
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[usable_cores()]]


def test_a_resumed_request_goes_on_from_the_tokens_it_had(pipe):
    """What a restart does: the request comes back with its tokens so far at the end of its prompt
    (``resumed``), and its constraint is rebuilt from them: the rest equals the undisturbed run."""
    engine = pipe._backend.engine
    prompt = pipe._encode(["Describe a person as JSON."], None, True)[0]
    params = SamplingParams(max_new_tokens=60, json_schema=Person.model_json_schema(), presence_penalty=0.5)
    whole = run(engine, 1, prompt, params)
    assert len(whole) > 12
    cut = 9
    rest = run(engine, 2, prompt + whole[:cut], SamplingParams(**{**_fields(params), "max_new_tokens": 60 - cut}),
               resumed=cut)
    assert whole[:cut] + rest == whole


def run(engine, rid, prompt, params, resumed=0) -> list[int]:
    engine.add_request(rid, list(prompt), params, resumed=resumed)
    while True:
        for out in engine.step():
            if out.request_id == rid:
                assert out.finish_reason in ("stop", "length"), out
                return out.token_ids


def _fields(params: SamplingParams) -> dict:
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def test_two_stages_give_the_tokens_of_one_process(pipe):
    schema = Person.model_json_schema()
    want = pipe.generate(PROMPTS[:2], chat=True, max_new_tokens=80, json_schema=schema)
    assert 0 < pipe.last_stats["constraint_s"] < pipe.last_stats["wall_s"]
    with Pipeline("smollm2-135m", stages=2) as two:
        got = two.generate(PROMPTS[:2], chat=True, max_new_tokens=80, json_schema=schema)
        first, last = two.last_stats["stages"]  # the last stage holds the constraints, inside its busy time
        assert first["constraint_s"] == 0 and 0 < last["constraint_s"] < last["busy_s"]
        two.generate(PROMPTS[:1], max_new_tokens=4)
        assert two.last_stats["stages"][1]["constraint_s"] == 0  # counted afresh each call: none held
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    pipe.generate(PROMPTS[:1], max_new_tokens=4)
    assert pipe.last_stats["constraint_s"] == 0


@pytest.mark.parametrize("fields, message", [
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}, "/missing"),
    ({"regex": "(unclosed"}, "unclosed group"),
    ({"grammar": "root ::= (("}, "cannot be compiled"),
    ({"regex": "a", "choice": ["b"]}, "at most one of"),
])
def test_a_constraint_that_cannot_run_is_refused_before_anything_runs(pipe, fields, message):
    before = pipe.status()
    with pytest.raises(ValueError, match=re.escape(message)):
        pipe.generate(["Hi"], max_new_tokens=4, **fields)
    assert pipe.status() == before


@pytest.mark.parametrize("layout", [dict(speculative="ngram"), dict(speculative="ngram", stages=2),
                                    dict(speculative="draft:smollm2-135m")], ids=["ngram", "ngram-stages2", "draft"])
def test_drafts_under_a_constraint_keep_the_greedy_tokens(pipe, layout):
    """Each verified position is masked with the constraint advanced through the drafts before it,
    and the constraint is rolled back to what was accepted: the tokens of decoding without drafts,
    and the JSON holds."""
    kwargs = dict(chat=True, max_new_tokens=80, temperature=0.0, json_schema=Person.model_json_schema())
    expected = pipe.generate(PROMPTS, **kwargs)
    with Pipeline("smollm2-135m", max_num_seqs=8, num_speculative_tokens=4, **layout) as spec:
        got = spec.generate(PROMPTS, **kwargs)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert sum(o.accepted_tokens for o in got) > 0 and sum(o.draft_tokens for o in got) > 0
    for out in got:
        if out.finish_reason == "stop":
            Person.model_validate_json(out.text)

"""Structured-output constraints on their own (SmolLM2's real tokenizer): the mask applied to the
logits is llguidance's bitmask, bit for bit; rows without a constraint are not touched; a
constraint advances, completes (then only EOS follows), rolls back and is rebuilt from its tokens;
what cannot be compiled is named."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")

from stagewise.engine.constraints import Constraint, compute_masks, grammar_text, problem, vocabulary  # noqa: E402
from stagewise.engine.params import SamplingParams  # noqa: E402
from stagewise.model.loader import open_checkpoint  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                                           "score": {"type": "number"}},
          "required": ["name", "tags", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def vocab():
    ckpt = open_checkpoint("smollm2-135m")
    cfg = ckpt.config
    return vocabulary(("test", str(ckpt.path)), ckpt.tokenizer, cfg.vocab_size, cfg.eos_token_ids)


@pytest.fixture(scope="module")
def tokenizer():
    return open_checkpoint("smollm2-135m").tokenizer()


def apply_masks(logits: torch.Tensor, constraints, vocab) -> torch.Tensor:
    """``logits`` with every constrained row's disallowed tokens at -inf (a new tensor; the given
    one when no row is constrained), as the executor applies the masks it computed."""
    masks = compute_masks(constraints, vocab)
    return logits if masks is None else masks.apply(logits)


def allowed_reference(matcher, n_vocab: int) -> torch.Tensor:
    """The tokens llguidance allows, read from the bitmask it returns as bytes (not the pointer
    the runtime fills)."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return torch.from_numpy(bits[:n_vocab].astype(bool))


def test_the_mask_is_llguidances_bitmask_and_free_rows_are_untouched(vocab, tokenizer):
    params = SamplingParams(json_schema=SCHEMA)
    c = Constraint(vocab, params, "r")
    c.consume(tokenizer.encode('{"name": "Al').ids)
    logits = torch.randn(3, vocab.n_vocab)
    out = apply_masks(logits, [None, c, None], vocab)
    want = allowed_reference(c.matcher.deep_copy(), vocab.n_vocab)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.equal(torch.isfinite(out[1]), want) and 0 < int(want.sum()) < vocab.n_vocab
    assert torch.equal(out[1][want], logits[1][want])
    assert apply_masks(logits, [None, None, None], vocab) is logits  # nothing constrained: no copy


def test_a_constraint_completes_then_only_eos_follows(vocab, tokenizer):
    c = Constraint(vocab, SamplingParams(choice=["yes", "no"]), "r")
    allowed = torch.isfinite(apply_masks(torch.zeros(1, vocab.n_vocab), [c], vocab)[0])
    firsts = {tokenizer.decode([t]) for t in allowed.nonzero().flatten().tolist()}
    assert firsts and all("yes".startswith(f) or "no".startswith(f) for f in firsts)
    c.consume(tokenizer.encode("no").ids)
    eos = list(vocab.eos_token_ids)
    after = torch.isfinite(apply_masks(torch.zeros(1, vocab.n_vocab), [c], vocab)[0])
    assert after.nonzero().flatten().tolist() == eos
    c.consume(eos * 3)  # ignore_eos goes on with EOS: nothing breaks
    assert c.tokens[-3:] == eos * 3
    with pytest.raises(ValueError, match="breaks its constraint"):
        Constraint(vocab, SamplingParams(choice=["yes", "no"]), "r2").consume(tokenizer.encode("maybe").ids)


def test_rollback_and_rebuild_give_the_same_state(vocab, tokenizer):
    text = tokenizer.encode('{"name": "Bo", "tags": ["a"], "score": 1.5}').ids
    params = SamplingParams(json_schema=SCHEMA)
    whole = Constraint(vocab, params, "r")
    whole.consume(text)
    whole.consume(list(vocab.eos_token_ids))
    whole.rollback(5)
    again = Constraint(vocab, params, "r", output_ids=text[:-4])  # what a resumed request rebuilds
    assert whole.tokens == again.tokens == text[:-4]
    logits = torch.zeros(2, vocab.n_vocab)
    masked = apply_masks(logits, [whole, again], vocab)
    assert torch.equal(masked[0], masked[1])
    with pytest.raises(ValueError, match="cannot roll its constraint back"):
        whole.rollback(len(text))


def masked_rows(c: Constraint, vocab) -> bool:
    return not torch.isfinite(apply_masks(torch.zeros(1, vocab.n_vocab), [c], vocab)[0]).all()


def test_constraint_after_leaves_the_thinking_free_then_holds(vocab, tokenizer):
    params = SamplingParams(choice=["yes", "no"], constraint_after="</think>")
    c = Constraint(vocab, params, "r")
    thinking = tokenizer.encode("<think>\nyes? maybe </thi").ids
    c.consume(thinking)  # "maybe" would break the choice: nothing holds yet
    assert not c.active and not masked_rows(c, vocab)
    end = tokenizer.encode("nk>").ids  # the text completes across tokens
    c.consume(end)
    assert c.active and masked_rows(c, vocab)
    free = Constraint(vocab, SamplingParams(choice=["yes", "no"]), "f")
    assert torch.equal(apply_masks(torch.zeros(1, vocab.n_vocab), [c], vocab),
                       apply_masks(torch.zeros(1, vocab.n_vocab), [free], vocab))  # the choice from its start
    with pytest.raises(ValueError, match="breaks its constraint"):
        Constraint(vocab, params, "b", output_ids=thinking + end).consume(tokenizer.encode("maybe").ids)
    answer = tokenizer.encode("no").ids
    c.consume(answer)
    # Rolled back into the thinking: free again; forward again: the same state as a rebuild.
    c.rollback(len(answer) + len(end))
    assert not c.active and not masked_rows(c, vocab) and c.tokens == thinking
    c.consume(end + answer)
    rebuilt = Constraint(vocab, params, "r2", output_ids=thinking + end + answer)
    assert c.active and rebuilt.active and c.tokens == rebuilt.tokens
    both = apply_masks(torch.zeros(2, vocab.n_vocab), [c, rebuilt], vocab)
    assert torch.equal(both[0], both[1]) and both[0].isfinite().nonzero().flatten().tolist() == \
        list(vocab.eos_token_ids)
    with pytest.raises(ValueError, match="constraint_after needs a constraint"):
        SamplingParams(constraint_after="</think>")


@pytest.mark.parametrize("fields", [
    {"json_schema": SCHEMA}, {"regex": r"\d{3}-[a-z]+"}, {"choice": ["red", "green"]},
    {"grammar": 'root ::= "a" ("b" | "c")*'}, {"grammar": 'start: "x" NUMBER\n%import common.NUMBER'},
])
def test_every_kind_compiles_once_and_is_cached(vocab, fields):
    params = SamplingParams(**fields)
    assert params.constrained and problem(params, vocab) is None
    text = grammar_text(params)
    assert text in vocab.grammars._compiled
    first = vocab.grammars.compile(params)
    assert first is not vocab.grammars._compiled[text]  # each request its own copy


@pytest.mark.parametrize("fields, message", [
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "/nope"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"grammar": "root ::= ("}, "cannot be compiled"),
])
def test_what_cannot_be_compiled_is_named(vocab, fields, message):
    why = problem(SamplingParams(**fields), vocab)
    assert why is not None and message in why and why.startswith("the constraint cannot be compiled")
    assert "needs the model's tokenizer" in problem(SamplingParams(**fields), None)


def test_the_sampling_fields_check_their_values():
    assert SamplingParams(json_schema=json.dumps(SCHEMA)).json_schema == SCHEMA
    assert not SamplingParams().constrained and SamplingParams(choice=("a",)).choice == ["a"]
    for fields, message in [({"json_schema": "[1]"}, "json_schema must be None or a JSON schema"),
                            ({"regex": ""}, "regex must be None or a non-empty regular expression"),
                            ({"choice": ["a", ""]}, "choice must be a list of non-empty strings"),
                            ({"regex": "a", "choice": ["b"]}, "at most one of json_schema, regex, grammar, choice")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**fields)

"""Structured output: a request's output held to a JSON schema, a regular expression, a grammar or
a list of choices, by masking the logits of the tokens that would break it.

The grammar engine is llguidance (MIT; a Rust library with a CPU wheel and no Python
dependencies). Each step it computes, for every constrained row, a bitmask of the tokens the
constraint allows next (one bit per vocabulary entry, 32 to an int32), and consumes the sampled
token afterwards. It lazily explores only the tokenizer's tokens the grammar reaches, so a mask
costs tens of microseconds on a 49k vocabulary, and it can roll tokens back (speculative
decoding's rejections). xgrammar, the other engine the anchors use, needs torch, transformers,
triton and a TVM runtime at run time; see docs/structured-output.md for the comparison.

Where it runs: the last stage's leader, beside the sampler (:mod:`stagewise.engine.executor`):
the constraint's state lives with the request there. The front end compiles the same constraint
once when a request arrives (:func:`problem`), so that a schema the engine cannot compile is an
error before anything runs, never a failed step.

Which tokens exist: a :class:`Vocabulary` is the model's tokenizer as llguidance sees it, sized to
the logits (an LM head wider than the tokenizer has its extra ids masked) with the model's EOS
ids as the ones that end a finished constraint. Built once per tokenizer and process (~0.4 s for
SmolLM2's 49,152 tokens); compiled constraints are kept by their text (:class:`Grammars`), each
request starting from a copy.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from stagewise.engine.params import SamplingParams

if TYPE_CHECKING:
    import torch

GRAMMAR_CACHE = 64
"""Compiled constraints kept per vocabulary, least recently used dropped first."""
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"
"""What may stand between a JSON value's tokens: a space, or a line break and an indent of at most
20 (llama.cpp's JSON-schema grammars allow as much). Unbounded whitespace lets a small model pad
an answer until its length runs out; a schema's own ``x-guidance`` options override it."""


def grammar_text(params: SamplingParams) -> str | None:
    """The llguidance grammar of a request's constraint (None: it has none)."""
    import llguidance

    if params.json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(params.json_schema),
                                                             defaults={"whitespace_pattern": JSON_WHITESPACE})
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.grammar is not None:  # Lark as llguidance reads it, or GBNF (llama.cpp's), converted
        return llguidance.grammar_from("grammar", params.grammar)
    if params.choice:
        return llguidance.grammar_from("choice", params.choice)
    return None


class Vocabulary:
    """A tokenizer as llguidance sees it, built when first needed (thread-safe)."""

    def __init__(self, load: Callable[[], Any], n_vocab: int, eos_token_ids: Sequence[int]) -> None:
        """``load()`` returns the ``tokenizers.Tokenizer``; ``n_vocab``: the logits' width."""
        self._load, self.n_vocab, self.eos_token_ids = load, int(n_vocab), tuple(eos_token_ids)
        self._lock = threading.Lock()
        self._ll = None
        self.grammars = Grammars(self)

    @property
    def ll(self):
        """The ``llguidance.LLTokenizer``."""
        with self._lock:
            if self._ll is None:
                import llguidance

                tokenizer = self._load()
                if tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer; this checkpoint has none")
                self._ll = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=self.n_vocab,
                                                  eos_token=list(self.eos_token_ids) or None)
            return self._ll

    @property
    def mask_words(self) -> int:
        """int32 words in one row's bitmask."""
        return (self.n_vocab + 31) // 32


_VOCABULARIES: OrderedDict[Hashable, Vocabulary] = OrderedDict()
_VOCABULARIES_LOCK = threading.Lock()


def vocabulary(key: Hashable, load: Callable[[], Any], n_vocab: int, eos_token_ids: Sequence[int]) -> Vocabulary:
    """This process's :class:`Vocabulary` of the tokenizer ``key`` names (a checkpoint path, say),
    built by ``load`` when first used; kept for the next caller (the four most recent)."""
    full = (key, int(n_vocab), tuple(eos_token_ids))
    with _VOCABULARIES_LOCK:
        found = _VOCABULARIES.get(full)
        if found is None:
            found = _VOCABULARIES[full] = Vocabulary(load, n_vocab, eos_token_ids)
            while len(_VOCABULARIES) > 4:
                _VOCABULARIES.popitem(last=False)
        _VOCABULARIES.move_to_end(full)
        return found


class Grammars:
    """Compiled constraints of one vocabulary, by their grammar text."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: SamplingParams):
        """A fresh ``llguidance.LLMatcher`` of the request's constraint at its start. ValueError
        naming what the engine refused."""
        return self.template(params).deep_copy()

    def template(self, params: SamplingParams):
        """The cached compiled constraint (compiled now when not yet): never advanced, only
        copied. ValueError naming what the engine refused."""
        import llguidance

        try:
            text = grammar_text(params)
        except ValueError as err:
            raise ValueError(f"the constraint cannot be compiled: {err}") from None
        with self._lock:
            template = self._compiled.get(text)
            if template is not None:
                self._compiled.move_to_end(text)
                return template
        matcher = llguidance.LLMatcher(self.vocab.ll, text, log_level=0)  # drops the GIL while it compiles
        if matcher.is_error():
            raise ValueError(f"the constraint cannot be compiled: {matcher.get_error()}")
        with self._lock:
            self._compiled[text] = matcher
            while len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.popitem(last=False)
        return matcher


def problem(params: SamplingParams, vocab: Vocabulary | None) -> str | None:
    """What keeps a request's constraint from running (it cannot be compiled, or the model has no
    tokenizer), or None: the front end's check before the request is added."""
    if not params.constrained:
        return None
    if vocab is None:
        return "structured output (json_schema, regex, grammar, choice) needs the model's tokenizer; this " \
               "checkpoint has none"
    try:
        vocab.grammars.template(params)
    except ValueError as err:
        return str(err)
    return None


class Constraint:
    """One request's constraint on the last stage: which tokens may come next, advanced by each
    token it samples."""

    __slots__ = ("matcher", "request_id", "tokens", "_consumed")

    def __init__(self, grammars: Grammars, params: SamplingParams, request_id: Hashable,
                 output_ids: Sequence[int] = ()) -> None:
        """``output_ids``: tokens the request generated before (it resumes after a restart, or
        moves to another instance of the stage)."""
        self.request_id = request_id
        self.matcher = grammars.compile(params)
        self.tokens: list[int] = []
        """Every token it was given, in order (what rebuilds it elsewhere)."""
        self._consumed = 0
        """How many of :attr:`tokens` the matcher took (those after it completed are EOS)."""
        if output_ids:
            self.consume(output_ids)

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance past sampled tokens; ValueError when the constraint refuses one. Once the
        constraint is complete, only EOS follows, and it is not consumed (``ignore_eos`` requests
        go on with EOS until their length)."""
        for t in tokens:
            t = int(t)
            if not self.matcher.is_stopped():
                if not self.matcher.consume_token(t):
                    raise ValueError(f"request {self.request_id!r}: token {t} breaks its constraint: "
                                     f"{self.matcher.get_error()}")
                self._consumed = len(self.tokens) + 1
            self.tokens.append(t)

    def rollback(self, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` consumed (rejected speculative tokens)."""
        if num_tokens > len(self.tokens):
            raise ValueError(f"request {self.request_id!r}: cannot roll its constraint back {num_tokens} tokens, "
                             f"it consumed {len(self.tokens)}")
        keep = len(self.tokens) - num_tokens
        if self._consumed > keep:
            if not self.matcher.rollback(self._consumed - keep):
                raise ValueError(f"request {self.request_id!r}: its constraint cannot roll back: "
                                 f"{self.matcher.get_error()}")
            self._consumed = keep
        del self.tokens[keep:]


def apply_masks(logits: torch.Tensor, constraints: Sequence[Constraint | None], vocab: Vocabulary) -> torch.Tensor:
    """``logits [B, V]`` with every constrained row's disallowed tokens at -inf (a new tensor; the
    given one, untouched, when no row is constrained). Rows without a constraint are not read."""
    import numpy as np
    import torch

    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    words = vocab.mask_words
    masks = np.empty((len(rows), words), dtype=np.int32)
    for j, i in enumerate(rows):  # one row after the other: llguidance's threads lost to torch's on 2 cores
        c = constraints[i]
        c.matcher.unsafe_compute_mask_ptr(masks.ctypes.data + j * words * 4, words * 4)
        if c.matcher.is_error():
            raise ValueError(f"request {c.request_id!r}: its constraint failed: {c.matcher.get_error()}")
    # Bit j of a row's word w is token 32 w + j: the little-endian bytes' bits in order.
    allowed = torch.from_numpy(np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")
                               .view(np.bool_)[:, : logits.size(1)]).to(logits.device)
    if len(rows) == logits.size(0):
        return torch.where(allowed, logits, float("-inf"))
    out = logits.clone()
    idx = torch.tensor(rows, device=logits.device)
    out.index_copy_(0, idx, torch.where(allowed, logits.index_select(0, idx), float("-inf")))
    return out

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
the constraint's state lives with the request there. A step's masks are computed on a thread of
their own while the forward pass runs (:func:`masks_ahead`) and applied to the logits by the
``apply_token_bitmask`` op, which reads the bits as they are. The front end compiles the same constraint
once when a request arrives (:func:`problem`), so that a schema the engine cannot compile is an
error before anything runs, never a failed step.

Which tokens exist: a :class:`Vocabulary` is the model's tokenizer as llguidance sees it, sized to
the logits (an LM head wider than the tokenizer has its extra ids masked) with the model's EOS
ids as the ones that end a finished constraint. Built once per tokenizer and process (~0.4 s for
SmolLM2's 49,152 tokens); compiled constraints are kept by their text (:class:`Grammars`), each
request starting from a copy.
"""

from __future__ import annotations

import concurrent.futures
import functools
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
    token it samples. With ``constraint_after``, the tokens up to the one that completes that text
    are free (a reasoning model's thinking): the constraint holds from the next token on."""

    __slots__ = ("matcher", "request_id", "tokens", "_consumed", "_vocab", "_after", "_tail", "_start")

    def __init__(self, vocab: Vocabulary, params: SamplingParams, request_id: Hashable,
                 output_ids: Sequence[int] = ()) -> None:
        """``output_ids``: tokens the request generated before (it resumes after a restart, or
        moves to another instance of the stage)."""
        self.request_id, self._vocab = request_id, vocab
        self.matcher = vocab.grammars.compile(params)
        self.tokens: list[int] = []
        """Every token it was given, in order (what rebuilds it elsewhere)."""
        self._after = params.constraint_after.encode() if params.constraint_after else b""
        self._start: int | None = None if self._after else 0
        """Where in :attr:`tokens` the constrained output begins (None: the text it waits for has
        not come yet)."""
        self._tail = b""
        """The output's last bytes while it waits, fewer than the text's."""
        self._consumed = 0
        """How many of :attr:`tokens` the matcher took or skipped (those after it completed are EOS)."""
        if output_ids:
            self.consume(output_ids)

    @property
    def active(self) -> bool:
        """Whether the constraint holds the next token."""
        return self._start is not None

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance past sampled tokens; ValueError when the constraint refuses one. Once the
        constraint is complete, only EOS follows, and it is not consumed (``ignore_eos`` requests
        go on with EOS until their length)."""
        for t in tokens:
            t = int(t)
            if self._start is None:
                self._wait(t)
            elif not self.matcher.is_stopped():
                if not self.matcher.consume_token(t):
                    raise ValueError(f"request {self.request_id!r}: token {t} breaks its constraint: "
                                     f"{self.matcher.get_error()}")
                self._consumed = len(self.tokens) + 1
            self.tokens.append(t)

    def _wait(self, token: int) -> None:
        seen = self._tail + self._vocab.ll.decode_bytes([token])
        if self._after in seen:
            self._start = self._consumed = len(self.tokens) + 1
            self._tail = b""
        else:
            self._tail = seen[len(seen) - len(self._after) + 1:]

    def rollback(self, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` consumed (rejected speculative tokens)."""
        if num_tokens > len(self.tokens):
            raise ValueError(f"request {self.request_id!r}: cannot roll its constraint back {num_tokens} tokens, "
                             f"it consumed {len(self.tokens)}")
        keep = len(self.tokens) - num_tokens
        if self._start is not None and self._consumed > max(keep, self._start):
            if not self.matcher.rollback(self._consumed - max(keep, self._start)):
                raise ValueError(f"request {self.request_id!r}: its constraint cannot roll back: "
                                 f"{self.matcher.get_error()}")
            self._consumed = max(keep, self._start)
        if self._after and (self._start is None or keep < self._start):  # waits again, from the kept tokens
            self._start, self._tail, self._consumed = None, b"", keep
            for t in self.tokens[max(0, keep - len(self._after)):keep]:  # every token is at least one byte
                self._wait(t)
        del self.tokens[keep:]


class Masks:
    """The computed bitmasks of a batch's constrained rows: ``bits[j]`` (int32, on the CPU) is row
    ``rows[j]``'s, ``index`` the rows as a tensor."""

    __slots__ = ("rows", "bits", "index")

    def __init__(self, rows: list[int], bits: torch.Tensor, index: torch.Tensor) -> None:
        self.rows, self.bits, self.index = rows, bits, index

    def apply(self, logits: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """``logits [B, V]`` with the rows' disallowed tokens at -inf: a new tensor, or with
        ``in_place`` the given one (when nothing reads the unmasked logits after: the sampler's
        log-probabilities do). The op reads the bits as they are (no unpacked copy): about a
        memset of each row's refused part."""
        from stagewise import ops

        out = logits if in_place else logits.clone()
        ops.apply_token_bitmask(out, self.bits.to(logits.device), self.index.to(logits.device))
        return out


class MaskBuffer:
    """Where an executor's masks are written, step after step: the bits' memory and the index
    tensors of recent sets of rows are kept, so that a step allocates nothing (a batch-1 decode
    step's sampling took ~0.2 ms longer with a fresh array, its address and an index each step).
    A step's :class:`Masks` are read before the next step's are computed."""

    def __init__(self, words: int) -> None:
        import torch

        self.words, self._bits = words, torch.empty(0, words, dtype=torch.int32)
        self._index: dict[tuple[int, ...], torch.Tensor] = {}

    def take(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The bits ``[len(rows), words]`` to fill, and the rows' index."""
        import torch

        if self._bits.size(0) < len(rows):
            self._bits = torch.empty(max(len(rows), 2 * self._bits.size(0)), self.words, dtype=torch.int32)
        index = self._index.get(key := tuple(rows))
        if index is None:
            if len(self._index) >= 64:
                self._index.clear()
            index = self._index[key] = torch.tensor(rows, dtype=torch.int64)
        return self._bits[:len(rows)], index


def compute_masks(constraints: Sequence[Constraint | None], vocab: Vocabulary,
                  buffer: MaskBuffer | None = None) -> Masks | None:
    """The bitmasks of the rows whose constraint holds their next token (None: no such row), in
    ``buffer`` (a new one if None). Rows without a constraint, or whose constraint waits for its
    ``constraint_after`` text, are not read."""
    rows = [i for i, c in enumerate(constraints) if c is not None and c.active]
    if not rows:
        return None
    bits, index = (buffer or MaskBuffer(vocab.mask_words)).take(rows)
    base, size = bits.data_ptr(), vocab.mask_words * 4
    # One row after the other, on this thread: shared with the mask thread while torch's threads
    # still spin after the forward pass, 16 rows took 1.03 ms instead of 0.74 on 2 cores.
    for j, i in enumerate(rows):
        c = constraints[i]
        c.matcher.unsafe_compute_mask_ptr(base + j * size, size)
        if c.matcher.is_error():
            raise ValueError(f"request {c.request_id!r}: its constraint failed: {c.matcher.get_error()}")
    return Masks(rows, bits, index)


@functools.cache
def _mask_thread() -> concurrent.futures.ThreadPoolExecutor:
    """One idle thread per process that uses constraints (its worker starts with the first mask
    and is joined at exit)."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="constraint-masks")


def masks_ahead(constraints: Sequence[Constraint | None], vocab: Vocabulary,
                buffer: MaskBuffer) -> concurrent.futures.Future | None:
    """:func:`compute_masks` started on this process's mask thread, so that it runs while the
    forward pass computes the logits (llguidance releases the GIL, as torch's kernels do): the
    sampler then waits only for what is left. None when no row is constrained. The rows'
    constraints must not advance until the result is taken."""
    if not any(c is not None and c.active for c in constraints):
        return None
    return _mask_thread().submit(compute_masks, list(constraints), vocab, buffer)

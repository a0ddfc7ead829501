"""What a request asks of sampling, and what it gets back, without torch (the command line checks
them before anything heavy is imported): :class:`SamplingParams`, :class:`SamplingRequest`,
:class:`TokenLogprobs`. The sampler itself is :mod:`stagewise.engine.sampling`.

:class:`SamplingParams` is the one definition of a sampling option: each field holds its default,
its check and, in its metadata (an :class:`Option`), the names it has outside the dataclass. Every
surface is derived from the fields (:data:`SURFACES` is the table):

==========================  =============================================================
surface                     a field ``top_k`` is
==========================  =============================================================
command line                ``--top-k`` (``generate``, ``launch``), its help from the field
``Pipeline.generate``       the keyword ``top_k``, defaulting to the field's default
a run plan's ``sampling:``  the key ``top_k`` (also a prompt file line's key)
OpenAI request              the field ``top_k`` (or the names :attr:`Option.openai` gives)
==========================  =============================================================

A new option is a field here (its docstring, its :func:`option`) and its code in the sampler.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed accepts without wrapping
MAX_LOGPROBS = 20


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class Option:
    """How a field of :class:`SamplingParams` is checked and named outside the dataclass."""

    check: Callable[[Any], bool]
    """True for a value the field takes."""
    expected: str
    """What :attr:`check` takes, in words, for the error that names a refused value."""
    help: str
    """The command line's help of its flag (its default is added to it)."""
    metavar: str | None = None
    """The command line's name of its value."""
    openai: tuple[str, ...] = ()
    """Its OpenAI request fields (both endpoints), when not the field's own name."""
    openai_chat: tuple[str, ...] = ()
    """Request fields only the chat endpoint reads for it, after :attr:`openai` (the last one a
    request gives sets the value)."""
    convert: Callable[[Any], Any] | None = None
    """What the dataclass keeps of a value its check took (a tuple as a list)."""
    file: bool = False
    """The command line's flag names a file that holds the value (JSON for a dict field)."""


def option(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None, **spec: Any):
    """A field of :class:`SamplingParams`: its default (or ``factory``) and its :class:`Option`."""
    meta = {"option": Option(**spec)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _str_list(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How one request picks its next tokens and when it stops."""

    max_new_tokens: int = option(
        64, check=lambda v: _is_int(v) and v >= 1, expected="an int >= 1", metavar="N",
        help="most tokens to generate; more than the model's length leaves is an error",
        openai=("max_tokens",), openai_chat=("max_completion_tokens",))
    """Most tokens to generate; >= 1."""
    temperature: float = option(
        0.0, check=lambda v: _is_number(v) and 0.0 <= v < float("inf"),
        expected="a finite number >= 0 (0 = greedy)", metavar="T", help="logits are divided by T; 0 = greedy")
    """Logits are divided by this; 0 selects greedy decoding (argmax), the default, so that a
    pipeline's tokens are those of one process (OpenAI's endpoint defaults to 1, as its clients
    expect)."""
    top_k: int = option(0, check=lambda v: _is_int(v) and v >= 0, expected="an int >= 0 (0 = off)", metavar="K",
                        help="keep the K most likely tokens; 0 = off")
    """Keep the k most likely tokens (ties at the k-th all kept); 0 turns it off."""
    top_p: float = option(1.0, check=lambda v: _is_number(v) and 0.0 < v <= 1.0, expected="a number in (0, 1]",
                          metavar="P", help="nucleus sampling: keep the most likely tokens of mass P; 1 = off")
    """Nucleus sampling mass in (0, 1]; 1 turns it off."""
    min_p: float = option(0.0, check=lambda v: _is_number(v) and 0.0 <= v <= 1.0,
                          expected="a number in [0, 1] (0 = off)", metavar="P",
                          help="drop tokens less likely than P times the most likely one; 0 = off")
    """In [0, 1]; sampling drops tokens less likely than ``min_p`` times the most likely one."""
    repetition_penalty: float = option(
        1.0, check=lambda v: _is_number(v) and 0.0 < v < float("inf"), expected="a finite number > 0 (1 = off)",
        metavar="R", help="divide (multiply) the positive (negative) logits of prompt and output tokens by R; 1 = off")
    """> 0; 1 turns it off. Logits of prompt and output tokens: divided (positive) or multiplied
    (negative) by it."""
    presence_penalty: float = option(
        0.0, check=lambda v: _is_number(v) and -2.0 <= v <= 2.0, expected="a number in [-2, 2] (0 = off)",
        metavar="X", help="subtract X (-2 .. 2) from the logits of tokens the output holds; 0 = off")
    """In [-2, 2]; subtracted once from the logit of every token the output already holds."""
    frequency_penalty: float = option(
        0.0, check=lambda v: _is_number(v) and -2.0 <= v <= 2.0, expected="a number in [-2, 2] (0 = off)",
        metavar="X", help="subtract X (-2 .. 2) per occurrence in the output; 0 = off")
    """In [-2, 2]; subtracted from a token's logit as many times as the output holds it."""
    seed: int | None = option(
        None, check=lambda v: v is None or _is_int(v) and _SEED_RANGE[0] <= v <= _SEED_RANGE[1],
        expected="None or an int in [0, 2**64 - 1]", metavar="S",
        help="seeds the sampling; with several prompts, prompt i samples from seed + i")
    """Seeds the request's own generator; None draws from torch's global generator."""
    stop: list[str] = option(
        factory=list, check=lambda v: isinstance(v, str) and bool(v) or isinstance(v, (list, tuple))
        and all(isinstance(s, str) and s for s in v), expected="a string or a list of non-empty strings",
        metavar="S", help="a stop string (repeatable)", convert=_str_list)
    """Generation ends before the first occurrence of any of these strings (a string alone is one
    stop string)."""
    stop_token_ids: list[int] = option(
        factory=list, check=lambda v: isinstance(v, (list, tuple)) and all(_is_int(t) and t >= 0 for t in v),
        expected="a list of ints >= 0", metavar="1,2,3", help="stop at any of these token ids", convert=list)
    """Generation ends at any of these tokens (in addition to the model's EOS ids)."""
    ignore_eos: bool = option(False, check=lambda v: isinstance(v, bool), expected="a bool",
                              help="generate past the model's end-of-sequence tokens")
    """Keep generating past the model's EOS ids (stop_token_ids and stop strings still apply);
    benchmarks use it so that every row decodes exactly max_new_tokens."""
    logprobs: int | None = option(
        None, check=lambda v: v is None or _is_int(v) and 0 <= v <= MAX_LOGPROBS,
        expected=f"None or an int in [0, {MAX_LOGPROBS}]", metavar="K",
        help=f"each token's log-probability and the K (0 .. {MAX_LOGPROBS}) most likely tokens', printed as "
             "JSON: with --json or --prompt-file", openai_chat=("top_logprobs",))
    """Return each generated token's log-probability and the ``logprobs`` most likely tokens'
    (0 .. 20; None: none). From the model's float32 logits, before penalties and temperature."""
    max_draft_tokens: int | None = option(
        None, check=lambda v: v is None or _is_int(v) and v >= 0, expected="None or an int >= 0", metavar="N",
        help="with speculative decoding on: at most N draft tokens a step for this request (0: none; default: "
             "--num-speculative-tokens)")
    """With speculative decoding on (:mod:`stagewise.engine.speculative`), at most this many drafts
    a step for this request (0: it decodes one token a step); None: the engine's length. Its tokens
    are the same either way (greedy) or distributed the same (sampling)."""

    json_schema: dict | None = option(
        None, check=lambda v: v is None or isinstance(v, dict) or isinstance(v, str) and json_object(v) is not None,
        expected="None or a JSON schema (an object, or its JSON text)", metavar="FILE", file=True,
        help="the output is JSON matching this schema (a file holding it)", openai=("guided_json",),
        convert=lambda v: json_object(v) if isinstance(v, str) else v)
    """The output is JSON that this schema validates (``{"type": "object"}``: any JSON object).
    At most one of ``json_schema``, ``regex``, ``grammar`` and ``choice``; see
    :mod:`stagewise.engine.constraints`."""
    regex: str | None = option(None, check=lambda v: v is None or isinstance(v, str) and bool(v),
                               expected="None or a non-empty regular expression", metavar="RE",
                               help="the output matches this regular expression", openai=("guided_regex",))
    """The output matches this regular expression (Rust regex syntax, anchored at both ends)."""
    grammar: str | None = option(
        None, check=lambda v: v is None or isinstance(v, str) and bool(v.strip()),
        expected="None or a grammar's text (Lark or GBNF)", metavar="FILE", file=True,
        help="the output follows this grammar: Lark (llguidance's) or GBNF (llama.cpp's); a file holding it",
        openai=("guided_grammar",))
    """The output follows this context-free grammar: Lark as llguidance reads it (``start: ...``),
    or GBNF, llama.cpp's (``root ::= ...``)."""
    choice: list[str] = option(
        factory=list, check=lambda v: isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v),
        expected="a list of non-empty strings", metavar="TEXT", help="the output is one of these strings (repeatable)",
        openai=("guided_choice",), convert=list)
    """The output is exactly one of these strings (empty: no such constraint)."""
    constraint_after: str | None = option(
        None, check=lambda v: v is None or isinstance(v, str) and bool(v), expected="None or a non-empty string",
        metavar="TEXT", help="the constraint holds only after the output's first TEXT (a reasoning model's </think>)")
    """The constraint holds from the token that completes this text's first occurrence in the
    output on (a reasoning model's ``</think>``: it thinks freely, then answers in the schema);
    None: from the first token. Only with a constraint."""

    def __post_init__(self) -> None:
        for name, check in _CHECKS:
            if not check(getattr(self, name)):
                raise ValueError(f"SamplingParams.{name} {value_problem(name, getattr(self, name))}")
        for name, convert in _CONVERTS:
            setattr(self, name, convert(getattr(self, name)))
        given = [name for name in CONSTRAINTS if getattr(self, name)]
        if len(given) > 1:
            raise ValueError(f"SamplingParams: at most one of {', '.join(CONSTRAINTS)} may be given, got "
                             f"{' and '.join(given)}")
        if self.constraint_after is not None and not given:
            raise ValueError(f"SamplingParams.constraint_after needs a constraint ({', '.join(CONSTRAINTS)})")

    @property
    def constrained(self) -> bool:
        """Whether a constraint holds the output to a schema, regex, grammar or choice."""
        return (self.json_schema is not None or self.regex is not None or self.grammar is not None
                or bool(self.choice))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether its tokens so far change its logits (a penalty is on)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


CONSTRAINTS = ("json_schema", "regex", "grammar", "choice")
"""The fields that constrain the output; at most one per request."""


def json_object(text: str) -> dict | None:
    """The JSON object ``text`` holds, or None (not JSON, or JSON but no object)."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


_OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in dataclasses.fields(SamplingParams)}
_CHECKS = tuple((name, opt.check) for name, opt in _OPTIONS.items())
_CONVERTS = tuple((name, opt.convert) for name, opt in _OPTIONS.items() if opt.convert is not None)
SAMPLING_FIELDS: tuple[str, ...] = tuple(_OPTIONS)
"""Every sampling option's name: a ``Pipeline.generate`` keyword, a run plan's ``sampling:`` key
and a prompt file line's key."""


@dataclass(frozen=True, slots=True)
class Surface:
    """The names one sampling field has on each surface."""

    field: str
    """The dataclass field, ``Pipeline.generate``'s keyword and a run plan's ``sampling:`` key."""
    flag: str
    """The command line's option."""
    openai: tuple[str, ...]
    """The OpenAI request fields of both endpoints."""
    openai_chat: tuple[str, ...]
    """The request fields only the chat endpoint adds."""


SURFACES: tuple[Surface, ...] = tuple(
    Surface(name, "--" + name.replace("_", "-"), opt.openai or (name,), opt.openai_chat)
    for name, opt in _OPTIONS.items())
"""The table of every sampling field's names, in field order."""


def options() -> Mapping[str, Option]:
    """Each field's :class:`Option`, by name."""
    return _OPTIONS


def defaults() -> dict[str, Any]:
    """Every field's default (fresh lists)."""
    return {name: getattr(SamplingParams(), name) for name in SAMPLING_FIELDS}


def value_problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for the field ``name`` (``must be ..., got ...``), or None."""
    opt = _OPTIONS[name]
    return None if opt.check(value) else f"must be {opt.expected}, got {value!r}"


def unknown_field(name: str) -> str:
    """The error for a name that is no sampling field, with the closest one."""
    close = difflib.get_close_matches(name, SAMPLING_FIELDS, n=1, cutoff=0.7)
    hint = f"did you mean {close[0]!r}?" if close else f"expected some of {', '.join(SAMPLING_FIELDS)}"
    return f"{name!r} is not a sampling option ({hint})"


def sampling_problems(values: Mapping[str, Any]) -> list[str]:
    """Every problem of these sampling values, each named on its own (so that all are): a name that
    is no field, a value its field refuses."""
    problems = []
    for name, value in values.items():
        if name not in _OPTIONS:
            problems.append(unknown_field(str(name)))
        elif (why := value_problem(name, value)) is not None:
            problems.append(f"{name} {why}")
    return problems


def sampling_keywords(func: Callable) -> Callable:
    """``func``, whose ``**sampling`` takes sampling options, shown (``inspect.signature``,
    ``help()``) with one keyword per field in its place, with the field's default."""
    signature = inspect.signature(func)
    kept = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    given = defaults()
    keywords = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=given[f.name], annotation=f.type)
                for f in dataclasses.fields(SamplingParams)]
    func.__signature__ = signature.replace(parameters=kept + keywords)
    return func


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """What the stage that samples needs of a request when its first step arrives."""

    params: SamplingParams
    prompt_ids: tuple[int, ...] = ()
    """The prompt, when a repetition penalty needs it (else empty)."""
    output_ids: tuple[int, ...] = ()
    """Tokens the request generated before a restart (the end of its resumed prompt), when a
    penalty or a constraint needs them: its history's output, its constraint's progress."""

    @classmethod
    def of(cls, params: SamplingParams, prompt_ids: Sequence[int], resumed: int = 0) -> SamplingRequest:
        """``resumed``: how many of ``prompt_ids``' last tokens the request generated before."""
        output = tuple(prompt_ids[len(prompt_ids) - resumed:]) if resumed and (params.penalised or params.constrained) \
            else ()
        prompt = tuple(prompt_ids[: len(prompt_ids) - resumed]) if params.repetition_penalty != 1.0 else ()
        return cls(params, prompt, output)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's log-probability and the most likely tokens' at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token, log-probability) of the ``logprobs`` most likely tokens, most likely first."""

"""The OpenAI API's request and response bodies for `/v1/completions` and
`/v1/chat/completions`: a request checked field by field into a prompt and
:class:`~stagewise.engine.params.SamplingParams` (:func:`parse_completion`, :func:`parse_chat`),
and the results shaped as OpenAI's clients read them, whole or as stream chunks.

Every problem is an :class:`ApiError` naming the field (``param``), which the server answers with
400 and OpenAI's error body.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from stagewise.serve import tools
from stagewise.serve.reasoning import Reasoning, reasoning_for
from stagewise.engine.params import CONSTRAINTS, SURFACES, SamplingParams, TokenLogprobs, value_problem

MAX_REQUEST_BYTES = 32 << 20
"""The default limit on a request's body (``serve --max-request-bytes``): a data: URL of one image
of the largest default size (20 MiB, 26.7 MiB as base64) fits."""
MAX_COMPLETION_LOGPROBS = 5  # what OpenAI's legacy completions endpoint allows
MAX_TOP_LOGPROBS = 20

# The fields each endpoint reads: every sampling option under its OpenAI names (OpenAI's, and
# vLLM's for the options OpenAI lacks: top_k, min_p, repetition_penalty, stop_token_ids,
# ignore_eos), and each endpoint's own. Any other field is refused, as OpenAI's API does: a
# misspelt field or a feature this server lacks would otherwise give an answer the client did not
# ask for, with nothing to say so.
_SAMPLING_FIELDS = frozenset(name for row in SURFACES for name in row.openai)
_COMMON_FIELDS = _SAMPLING_FIELDS | {"model", "n", "stream", "stream_options", "response_format", "structured_outputs"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "best_of"}
CHAT_FIELDS = _COMMON_FIELDS | {name for row in SURFACES for name in row.openai_chat} | {
    "messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"}
OPENAI_DEFAULTS = {"temperature": 1.0}
"""Where OpenAI's API documents another default than the option's own (its clients expect
sampling); ``max_tokens`` defaults to the server's ``--default-max-tokens``."""
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})
"""OpenAI's fields that change nothing in an answer of this server (accepted, not used)."""
UNSUPPORTED_FIELDS = {"functions": [], "function_call": "none",
                      "logit_bias": {}, "suffix": "", "audio": None,
                      "modalities": ["text"], "prediction": None, "reasoning_effort": None,
                      "web_search_options": None}
"""OpenAI's fields this server does not implement, each with the value that asks for nothing
(accepted, as is null): any other value is refused with 'not supported'."""


class ApiError(Exception):
    """A request the server answers with an error body (``status``, OpenAI's ``type`` and ``code``)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(kw_only=True)
class ApiRequest:
    """One checked request: what to run and how to answer."""

    chat: bool
    prompt: str | None = None
    """The prompt text (a chat's rendered template), or None with ``prompt_ids``."""
    prompt_ids: list[int] | None = None
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    """Top log-probabilities per token to answer with (None: no logprobs)."""
    created: int = field(default_factory=lambda: int(time.time()))
    images: list[tuple[str, str]] = field(default_factory=list)
    """The URL of each image of a chat, in order, with the part that gave it (``messages[i].content[j]``)."""
    max_tokens_param: str = "max_tokens"
    """The field that set max_tokens (a chat's ``max_completion_tokens``), named in its errors."""
    tools: tools.ToolCalling | None = None
    """A chat's tools and how it may call them (None: it has none)."""
    reasoning: Reasoning | None = None
    """Where a chat's thinking is, with the server's ``--reasoning-parser`` (None: no parser)."""


def _get(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(f"'{name}' must be {names}, got {type(value).__name__} {value!r}", param=name)
    return value


def _check_fields(body: dict, known: frozenset[str]) -> None:
    for name, value in body.items():
        if name in known or name in IGNORED_FIELDS or value is None:
            continue
        if name in UNSUPPORTED_FIELDS:
            if value != UNSUPPORTED_FIELDS[name]:
                raise ApiError(f"'{name}' is not supported by this server", param=name)
            continue
        raise ApiError(f"Unrecognized request argument supplied: {name}", param=name)


def _check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(f"The model '{model}' does not exist; this server serves '{served}'", param="model",
                       code="model_not_found")


def _sampling(body: dict, chat: bool, default_max: int, logprobs: int | None) -> tuple[SamplingParams, str]:
    """The sampling options of a request, each read from its OpenAI fields (the last of them sent),
    OpenAI's defaults where they differ from ours; and the name of the field that gave max_tokens.
    ``logprobs``: the endpoint's own reading of it."""
    if _get(body, "n", (int,), 1) != 1:
        raise ApiError("only n=1 is supported", param="n")
    values: dict[str, Any] = {"max_new_tokens": default_max, **OPENAI_DEFAULTS}
    sent: dict[str, str] = {}
    for row in SURFACES:
        for name in row.openai + (row.openai_chat if chat else ()):
            if body.get(name) is not None:
                values[row.field], sent[row.field] = body[name], name
    values["logprobs"] = logprobs  # (its fields' shape differs by endpoint: read by the endpoint)
    for name, (value, param) in _structured(body).items():
        values[name], sent[name] = value, param
    if sum(bool(values.get(name)) for name in CONSTRAINTS) > 1:
        given = ", ".join(sent.get(name, name) for name in CONSTRAINTS if values.get(name))
        raise ApiError(f"at most one output constraint may be given, got {given}", param=given.split(", ")[-1])
    if values.get("top_k") == -1:  # vLLM's spelling of "off"
        values["top_k"] = 0
    stop = values.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 16 or not all(isinstance(s, str) for s in stop):
            raise ApiError("'stop' must be a string or a list of at most 16 strings", param="stop")
        values["stop"] = [s for s in stop if s]  # an empty stop string stops nothing
    for field, value in values.items():
        if (why := value_problem(field, value)) is not None:
            param = sent.get(field, field)
            raise ApiError(f"{param} {why}", param=param)
    return SamplingParams(**values), sent.get("max_new_tokens", "max_tokens")


STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
"""vLLM's ``structured_outputs`` keys and the sampling field each sets."""


def _structured(body: dict) -> dict[str, tuple[Any, str]]:
    """The output constraint of OpenAI's ``response_format`` or vLLM's ``structured_outputs``:
    sampling field -> (value, the request field that gave it)."""
    out = {}
    fmt = _get(body, "response_format", (dict,))
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            out["json_schema"] = ({"type": "object"}, "response_format")
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError("response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
                               param="response_format")
            out["json_schema"] = (schema, "response_format")
        elif kind != "text":
            raise ApiError(f"response_format 'type' must be text, json_object or json_schema, got {kind!r}",
                           param="response_format")
    given = _get(body, "structured_outputs", (dict,))
    for key, value in (given or {}).items():
        if key not in STRUCTURED_OUTPUTS:
            raise ApiError(f"structured_outputs takes {', '.join(STRUCTURED_OUTPUTS)}, got {key!r}",
                           param="structured_outputs")
        if value is not None:
            out[STRUCTURED_OUTPUTS[key]] = (value, f"structured_outputs.{key}")
    return out


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", (bool,), False)
    opts = _get(body, "stream_options", (dict,), {})
    if opts and not stream:
        raise ApiError("'stream_options' is only allowed with stream=true", param="stream_options")
    return stream, bool(_get(opts, "include_usage", (bool,), False))


def parse_completion(body: Any, served: str, default_max: int = 16) -> ApiRequest:
    """A `/v1/completions` body (OpenAI's fields, plus vLLM's for the options OpenAI lacks)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS)
    _check_model(body, served)
    prompt = body.get("prompt")
    text, ids = None, None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise ApiError("'prompt' must be a string, a list of token ids, or a list holding one of them "
                       "(one prompt per request)", param="prompt")
    if _get(body, "echo", (bool,), False):
        raise ApiError("'echo' is not supported", param="echo")
    if _get(body, "best_of", (int,), 1) != 1:
        raise ApiError("only best_of=1 is supported", param="best_of")
    logprobs = _get(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise ApiError(f"'logprobs' must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {logprobs}", param="logprobs")
    stream, usage = _stream_options(body)
    params, max_name = _sampling(body, False, default_max, logprobs)
    return ApiRequest(chat=False, prompt=text, prompt_ids=ids, params=params, stream=stream, include_usage=usage,
                      logprobs=logprobs, max_tokens_param=max_name)


def chat_messages(body: dict) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The ``messages`` as the chat template takes them, and the URLs of their images, in order,
    each with the part it came from (``messages[i].content[j]``). A message's text parts are joined
    into its content; one with ``image_url`` parts keeps a list of ``{"type": "image"}`` and
    ``{"type": "text"}`` parts in the order given, where the template puts an image's
    placeholder."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    out, images = [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(f"{where} must be an object whose 'role' is system, developer, user, assistant or tool",
                           param=where)
        content = m.get("content")
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls is not None and (not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                for c in calls)):
            raise ApiError(f"{where}.tool_calls must be a list of {{'id': ..., 'type': 'function', 'function': "
                           f"{{'name': ..., 'arguments': ...}}}}", param=f"{where}.tool_calls")
        if content is None and calls:
            content = ""
        if isinstance(content, list):
            parts = [_content_part(part, f"{where}.content[{j}]", m["role"], images) for j, part in enumerate(content)]
            if all(p["type"] == "text" for p in parts):
                content = "".join(p["text"] for p in parts)
            else:
                content = parts
        elif not isinstance(content, str):
            raise ApiError(f"{where}.content must be a string or a list of text and image_url parts",
                           param=f"{where}.content")
        message = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                message[key] = m[key]
        out.append(message)
    return out, images


def _content_part(part: Any, where: str, role: str, images: list[tuple[str, str]]) -> dict[str, str]:
    """One part of a message's content for the template; an image's URL goes to ``images``."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str) or not url:
            raise ApiError(f"{where}: an image_url part needs 'image_url': {{'url': '...'}} (a data: or http(s) URL)",
                           param=where)
        if role != "user":
            raise ApiError(f"{where}: images are taken in user messages only, not in a {role} message", param=where)
        images.append((where, url))
        return {"type": "image"}
    raise ApiError(f"{where}: a content part must be {{'type': 'text', 'text': ...}} or "
                   f"{{'type': 'image_url', 'image_url': {{'url': ...}}}}", param=where)


def parse_chat(body: Any, served: str, render, default_max: int, *, vision: bool = False,
               template: str | None = None, reasoning_parser: str | None = None) -> ApiRequest:
    """A `/v1/chat/completions` body; ``render(messages, tools, template_kwargs)`` applies the chat
    template (``template``, whose tool-call format :mod:`~stagewise.serve.tools` reads); ``vision``:
    whether the model takes images; ``reasoning_parser``: :mod:`~stagewise.serve.reasoning`'s."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS)
    _check_model(body, served)
    try:
        calling = tools.parse_tools(body, template)
    except tools.ToolError as err:
        raise ApiError(str(err), param=err.param) from None
    messages, images = chat_messages(body)
    if images and not vision:
        where = images[0][0]
        raise ApiError(f"{where}: this model takes no images (it has no vision tower)", param=where)
    want = _get(body, "logprobs", (bool,), False)
    top = _get(body, "top_logprobs", (int,))
    if top is not None and not want:
        raise ApiError("'top_logprobs' needs logprobs=true", param="top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", param="top_logprobs")
    logprobs = (top or 0) if want else None
    stream, usage = _stream_options(body)
    params, max_name = _sampling(body, True, default_max, logprobs)
    if calling is not None and (schema := calling.schema()) is not None:
        if params.constrained:
            raise ApiError("tool_choice required or a named function constrains the output already; drop the "
                           "response_format or structured_outputs", param="tool_choice")
        params = dataclasses.replace(params, json_schema=schema)
    extra = _get(body, "chat_template_kwargs", (dict,), {})
    try:
        shown = None if calling is None else calling.template_tools()
        prompt = render(tools.template_messages(messages, calling), shown, extra)
    except (ValueError, KeyError, TypeError) as err:
        raise ApiError(f"the chat template cannot render these messages: {err}",
                       param="chat_template_kwargs" if "chat_template_kwargs" in str(err) else "messages") from None
    reasoning = None if reasoning_parser is None else reasoning_for(reasoning_parser, prompt)
    if reasoning is not None and params.constrained and params.constraint_after is None:
        params = dataclasses.replace(params, constraint_after=reasoning.constraint_after)
    return ApiRequest(chat=True, prompt=prompt, params=params, stream=stream, include_usage=usage, logprobs=logprobs,
                      images=images, max_tokens_param=max_name, tools=calling, reasoning=reasoning)


# ---- responses ---------------------------------------------------------------------------------

FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(entries: list[TokenLogprobs | None], piece, offset: int = 0) -> dict:
    """The legacy completions' logprobs object of these tokens; ``piece(id)`` is a token's text."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        if e is None:
            continue
        text = piece(e.token)
        tokens.append(text)
        lps.append(e.logprob)
        tops.append({piece(t): lp for t, lp in e.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprobs | None], piece) -> dict:
    """The chat endpoint's logprobs object (``content``: one entry per token)."""
    def one(token: int, lp: float) -> dict:
        text = piece(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries if e is not None]}


def body(req: ApiRequest, rid: str, model: str, choice: dict, use: dict | None, chunk: bool = False) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if req.chat else "text_completion"
    out = {"id": rid, "object": kind, "created": req.created, "model": model, "choices": [choice] if choice else []}
    if use is not None:
        out["usage"] = use
    return out

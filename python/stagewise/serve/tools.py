"""OpenAI tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice``,
``parallel_tool_calls``, and ``tool`` messages fed back through the chat template.

- ``tool_choice: "required"`` or a named function: the output is constrained to a call, so any
  model produces a valid one. Named: the output is the function's arguments, JSON that its
  ``parameters`` schema validates. Required: a JSON array of ``{"name": ..., "arguments": ...}``
  (one item unless ``parallel_tool_calls``), each item's arguments validated by its function's
  schema.
- ``"auto"`` (the default with tools): the model decides; its own format is parsed, by the family
  its chat template shows (:data:`FAMILIES`):

  ========  =====================================================  ================================
  family    a template that                                        a call in the output
  ========  =====================================================  ================================
  hermes    writes ``<tool_call>`` (Qwen2.5, Qwen3, Hermes)          ``<tool_call>{"name": .., "arguments": ..}</tool_call>``
  llama3    writes ``<|python_tag|>`` or an ``ipython`` role         ``{"name": .., "parameters": ..}`` (``;`` between calls)
  generic   takes no ``tools`` (SmolLM2's): a system message         ``{"name": .., "arguments": ..}``
            listing them is added
  ========  =====================================================  ================================

- ``"none"``: the tools are not shown to the model and nothing is parsed.

A parsed call goes out as OpenAI's ``tool_calls`` with ``finish_reason: "tool_calls"``; text
outside the calls is the message's ``content``. A call's ``arguments`` is the text the model
wrote for them (a value written as a JSON string: that string), so a streamed answer
(:mod:`stagewise.serve.tool_stream`, which finds calls as they are written with
:class:`CallScanner`) sends the same text in pieces.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from stagewise.engine.params import json_object

FAMILIES = ("hermes", "llama3", "generic")


class ToolError(ValueError):
    """A ``tools`` or ``tool_choice`` the server refuses; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools and how it may call them."""

    tools: tuple[dict, ...]
    """Each tool's ``function`` object: ``name``, ``description``, ``parameters`` (a JSON schema)."""
    choice: str
    """``auto``, ``required``, ``named`` or ``none``."""
    named: str | None
    parallel: bool
    family: str

    def schema(self) -> dict | None:
        """The JSON schema the output is held to (``required`` and named), else None. A function's
        arguments hold its declared parameters only, unless its schema says ``additionalProperties``
        (a small model otherwise invents more, and may not stop)."""
        by_name = {t["name"]: _declared_only(t.get("parameters") or {"type": "object"}) for t in self.tools}
        if self.choice == "named":
            return by_name[self.named]
        if self.choice != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, params in by_name.items()]
        return {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1,
                **({} if self.parallel else {"maxItems": 1})}

    def template_tools(self) -> list[dict] | None:
        """What the chat template is given as ``tools`` (None: nothing)."""
        if self.choice == "none" or self.family == "generic":
            return None
        return [{"type": "function", "function": t} for t in self.tools]

    def system_prompt(self) -> str | None:
        """The tools described for a template that takes none (the generic family)."""
        if self.choice == "none" or self.family != "generic":
            return None
        return ("You can call these functions:\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools)
                + '\nTo call one, answer with only a JSON object: {"name": <function name>, "arguments": '
                  "<its arguments>}.")

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """The output's content (None when it is only calls) and its calls, OpenAI's shape."""
        if self.choice == "named":
            return None, [_call(self.named, text.strip())]
        if self.choice == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut off by max_tokens: no valid call
            raws = scan_calls(text, 2)
            return None, [_call(i["name"], i["arguments"], raws[k].arguments if k < len(raws) else None)
                          for k, i in enumerate(items)]
        if self.choice == "none":
            return text, []
        return _parse_auto(text, self.family, {t["name"] for t in self.tools})


def parse_tools(body: dict, template: str | None) -> ToolCalling | None:
    """The request's ``tools``/``tool_choice``/``parallel_tool_calls`` (None: it has no tools).
    ToolError naming the field for anything wrong."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                            f"{{...}}}}}}", f"tools[{i}]")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema (an object)", f"tools[{i}]")
        functions.append({k: v for k, v in fn.items() if k in ("name", "description", "parameters", "strict")})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("'tools' names a function twice", "tools")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if named not in names:
            raise ToolError(f"'tool_choice' must name one of the tools ({', '.join(names)}): "
                            "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        choice = "named"
    elif choice not in ("auto", "required", "none"):
        raise ToolError("'tool_choice' must be auto, required, none or {'type': 'function', 'function': "
                        "{'name': ...}}", "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a bool", "parallel_tool_calls")
    return ToolCalling(tuple(functions), choice, named, parallel, family(template))


def family(template: str | None) -> str:
    """The tool-call format a chat template shows (:data:`FAMILIES`)."""
    template = template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "generic"


def template_messages(messages: list[dict], calling: ToolCalling | None) -> list[dict]:
    """``messages`` as the template takes them: an assistant's ``tool_calls`` with their arguments
    as objects (templates write them with ``tojson``); for the generic family the tools' system
    message first, and each call written into its message's content."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            calls = [{**c, "function": {**c["function"], "arguments": _as_object(c["function"].get("arguments"))}}
                     for c in calls]
            m = {**m, "tool_calls": calls}
            if calling is None or calling.family == "generic":
                text = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                            ensure_ascii=False) for c in calls)
                m = {**m, "content": ((m.get("content") or "") + "\n" + text).strip()}
        out.append(m)
    prompt = calling.system_prompt() if calling is not None else None
    if prompt:
        if out and out[0]["role"] == "system" and isinstance(out[0]["content"], str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _declared_only(schema: dict) -> dict:
    if "properties" in schema and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def _as_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(name: str, arguments: Any, written: str | None = None) -> dict:
    """OpenAI's call; its arguments are the text the model ``written`` when that text holds them."""
    if written is not None and (written == arguments if isinstance(arguments, str) else _holds(written, arguments)):
        text = written
    else:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def _holds(text: str, value: Any) -> bool:
    try:
        return json.loads(text) == value
    except ValueError:
        return False


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _parse_auto(text: str, family: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """Calls in a free output; an output that holds none (or none of these tools) is content."""
    calls = []
    if family == "hermes":
        rest = text
        for found in _HERMES.finditer(text):
            obj = json_object(found.group(1))
            if obj is None or obj.get("name") not in names:
                return text, []
            calls.append(_call(obj["name"], obj.get("arguments", {}), _written(found.group(1))))
            rest = rest.replace(found.group(0), "", 1)
        return (rest.strip() or None) if calls else text, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    for part in body.split(";") if family == "llama3" else [body]:
        obj = json_object(part)
        if obj is None or obj.get("name") not in names:
            return text, []
        calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {})), _written(part)))
    return None, calls


def _written(text: str) -> str | None:
    found = scan_calls(text, 1)
    return found[0].arguments if len(found) == 1 else None


def scan_calls(text: str, depth: int) -> list[FoundCall]:
    """The calls of a whole text (:class:`CallScanner`) that have a name."""
    scanner = CallScanner(depth)
    scanner.feed(text)
    return [c for c in scanner.calls if c.name is not None]


ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class FoundCall:
    """A call object :class:`CallScanner` has read (all or part of)."""

    name: str | None = None
    """Its ``"name"`` once the string is whole (None before, or if it is not a string)."""
    raw: list[str] = field(default_factory=list)
    """The characters of its arguments' value, as written."""
    started: bool = False
    quoted: bool = False
    """The arguments are written as a JSON string (the call's arguments are that string's text)."""
    done: bool = False

    @property
    def arguments(self) -> str | None:
        """The arguments' text once the value is whole (None before, or if it is not valid)."""
        if not self.done:
            return None
        text = "".join(self.raw).strip()
        if not self.quoted:
            return text
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return value if isinstance(value, str) else None

    def ready(self) -> str:
        """The arguments' text that may go out now: always a beginning of :attr:`arguments`."""
        if self.done:
            return self.arguments or ""
        return "" if self.quoted else "".join(self.raw).rstrip()


class CallScanner:
    """The calls in JSON text as it arrives, one character after the other. A call is an object
    ``depth`` levels down (1: top-level objects, with any text between them skipped, as a
    ``<tool_call>`` marker; 2: the objects of a top-level array) with a string ``"name"`` and an
    ``"arguments"`` (or ``"parameters"``) value, read as written."""

    def __init__(self, depth: int) -> None:
        self.calls: list[FoundCall] = []
        self._at, self._depth, self._object = depth, 0, False
        self._in_str = self._esc = self._arg_start = False
        self._expect = "key"  # at the calls' depth: key, keystr, colon, value, after
        self._key: str | None = None
        self._buf: list[str] | None = None  # a key or a name being read
        self._args: FoundCall | None = None  # the call whose arguments are being read

    def feed(self, text: str) -> None:
        for ch in text:
            if self._in_str:
                self._string_char(ch)
                continue
            if self._arg_start:
                if ch.isspace():
                    continue
                self._arg_start, self._args = False, self.calls[-1]
                self._args.quoted = ch == '"'
            d = self._depth
            if self._args is not None:
                if d == self._at and ch in ",}]":
                    self._args.done, self._args = True, None
                else:
                    self._args.raw.append(ch)
            if d == self._at and self._object and self._expect == "value" and not ch.isspace():
                self._expect = "after"
                if ch == '"' and self._key == "name":
                    self._buf = []
            if ch == '"':
                if d:  # between top-level values, text is skipped
                    self._in_str = True
                    if d == self._at and self._object and self._expect == "key":
                        self._buf, self._expect = [], "keystr"
            elif ch in "{[":
                self._depth += 1
                if self._depth == self._at:
                    self._object, self._expect = ch == "{", "key"
                    if self._object:
                        self.calls.append(FoundCall())
            elif ch in "}]":
                self._depth = max(0, d - 1)
            elif d == self._at and self._object:
                if ch == ":" and self._expect == "colon":
                    self._expect = "value"
                    if self._key in ARGUMENT_KEYS and not self.calls[-1].started:
                        self.calls[-1].started = self._arg_start = True
                elif ch == ",":
                    self._expect = "key"

    def _string_char(self, ch: str) -> None:
        if self._buf is not None:
            self._buf.append(ch)
        if self._args is not None:
            self._args.raw.append(ch)
        if self._esc:
            self._esc = False
        elif ch == "\\":
            self._esc = True
        elif ch == '"':
            self._in_str = False
            if self._buf is None:
                return
            try:
                value = json.loads('"' + "".join(self._buf))
            except ValueError:
                value = None
            self._buf = None
            if self._expect == "keystr":
                self._key, self._expect = value, "colon"
            elif isinstance(value, str):
                self.calls[-1].name = value

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

A parsed call goes out as OpenAI's ``tool_calls`` (streamed as ``delta.tool_calls``, the call
whole in one chunk once the output ends) with ``finish_reason: "tool_calls"``; text outside the
calls is the message's ``content``.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
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
            return None, [_call(self.named, text)]
        if self.choice == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut off by max_tokens: no valid call
            return None, [_call(i["name"], i["arguments"]) for i in items]
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


def _call(name: str, arguments: Any) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": text}}


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
            calls.append(_call(obj["name"], obj.get("arguments", {})))
            rest = rest.replace(found.group(0), "", 1)
        return (rest.strip() or None) if calls else text, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    for part in body.split(";") if family == "llama3" else [body]:
        obj = json_object(part)
        if obj is None or obj.get("name") not in names:
            return text, []
        calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
    return None, calls


class ToolStream:
    """A streamed answer with tools: text goes out as it comes until it may be a call (the family's
    marker begins); from there it is held until the end, when :meth:`finish` parses it."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling, self.text, self.sent = calling, "", 0
        self.holding = calling.choice in ("required", "named")

    def feed(self, delta: str) -> str:
        """What of the output so far may go out now."""
        self.text += delta
        if self.calling.choice == "none":
            return self._release(len(self.text))
        if self.holding:
            return ""
        marker = "<tool_call>" if self.calling.family == "hermes" else None
        if marker is None:  # a call is the whole output: hold while it may begin with one
            head = self.text.lstrip()
            if head[:1] in ("{", "<") or not head:
                self.holding = bool(head)
                return ""
            return self._release(len(self.text))
        at = self.text.find(marker, self.sent)
        if at >= 0:
            self.holding = True
            return self._release(at)
        keep = next((k for k in range(min(len(marker) - 1, len(self.text) - self.sent), 0, -1)
                     if self.text.endswith(marker[:k])), 0)  # a marker's beginning stays until it is told
        return self._release(len(self.text) - keep)

    def _release(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The content not yet sent and the calls, once the output ended."""
        if self.calling.choice == "none":
            return self._release(len(self.text)), []
        content, calls = self.calling.parse(self.text[self.sent:] if self.sent else self.text)
        if not calls:
            return self._release(len(self.text)), []
        return content or "", calls

"""A streamed answer with tools (:mod:`stagewise.serve.tools`): text goes out as it comes until it
may be a call (the family's marker begins; for a family whose calls are the whole output, its
first character is ``{``). From there each call goes out as the model writes it, as OpenAI
streams: its id and name once the name's string is whole, then its arguments' text piece by
piece (``delta.tool_calls``). At the end the whole output is parsed as a whole answer is
(:meth:`~stagewise.serve.tools.ToolCalling.parse`), and what the stream has not sent of that goes
out: the rest of each call's arguments, a call not recognised while it was written, content."""

from __future__ import annotations

from stagewise.serve.tools import CallScanner, ToolCalling, call_id


class ToolStream:
    def __init__(self, calling: ToolCalling) -> None:
        self.calling, self.text, self.sent = calling, "", 0
        self.holding = calling.choice in ("required", "named")
        self._scanner = CallScanner(2 if calling.choice == "required" else 1)
        self._scanned = 0  # characters of the held text given to the scanner
        self._names = {t["name"] for t in calling.tools}
        self._out: list[list[str]] = []  # each call streamed: [its id, the arguments sent]
        self._lost = False  # a call named no tool: nothing more is streamed

    @property
    def called(self) -> bool:
        """Whether a call went out."""
        return bool(self._out)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """What of the output so far may go out now: content, and ``delta.tool_calls`` items."""
        self.text += delta
        if self.calling.choice == "none":
            return self._release(len(self.text)), []
        content = "" if self.holding else self._content()
        return content, (self._calls() if self.holding else [])

    def finish(self) -> tuple[str, list[dict]]:
        """The content not yet sent and the calls' items not yet sent, once the output ended."""
        if self.calling.choice == "none":
            return self._release(len(self.text)), []
        content, calls = self.calling.parse(self.text[self.sent:] if self.sent else self.text)
        if not self._out:
            if not calls:
                return self._release(len(self.text)), []
            return content or "", [{"index": i, **c} for i, c in enumerate(calls)]
        items = []
        for k, call in enumerate(calls):
            if k >= len(self._out):
                items.append({"index": k, **call})
                continue
            final, sent = call["function"]["arguments"], self._out[k][1]
            if len(final) > len(sent) and final.startswith(sent):
                items.append({"index": k, "function": {"arguments": final[len(sent):]}})
        return (content or "") if calls else "", items

    def end(self, delta: str) -> tuple[str, list[dict]]:
        """:meth:`feed` of the output's last text, then :meth:`finish`: one chunk's content and
        items, a call's pieces merged into one item."""
        content, items = self.feed(delta)
        more, rest = self.finish()
        merged: dict[int, dict] = {}
        for item in items + rest:
            if item["index"] in merged:
                merged[item["index"]]["function"]["arguments"] += item["function"].get("arguments", "")
            else:
                merged[item["index"]] = item
        return content + more, list(merged.values())

    def _content(self) -> str:
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

    def _calls(self) -> list[dict]:
        """The items of the calls written so far that have not gone out."""
        held = self.text[self.sent:]
        if self.calling.choice == "named":
            found = [(self.calling.named, held.strip())]
        else:
            self._scanner.feed(held[self._scanned:])
            self._scanned, found = len(held), []
            for c in self._scanner.calls:
                if c.name is None:
                    if c.done:
                        continue  # an object that is not a call
                    break  # its name may come after its arguments: wait for it
                if c.name not in self._names:
                    self._lost = True
                found.append((c.name, c.ready()))
        if self._lost:
            return []
        items: list[dict] = []
        for k, (name, arguments) in enumerate(found):
            if k == len(self._out):
                self._out.append([call_id(), ""])
                items.append({"index": k, "id": self._out[k][0], "type": "function",
                              "function": {"name": name, "arguments": ""}})
            sent = self._out[k][1]
            if len(arguments) > len(sent):
                self._out[k][1] = arguments
                if items and items[-1]["index"] == k:
                    items[-1]["function"]["arguments"] += arguments[len(sent):]
                else:
                    items.append({"index": k, "function": {"arguments": arguments[len(sent):]}})
        return items

    def _release(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

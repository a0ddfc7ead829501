"""A reasoning model's thinking apart from its answer (``serve --reasoning-parser``): the text
between ``<think>`` and ``</think>`` goes to the message's ``reasoning_content`` (streamed as
``delta.reasoning_content``), the rest to ``content``, where tool calls are looked for.

Where the thinking is, the rendered prompt says (:func:`reasoning_for`):

- the prompt closed an empty block (``<think>\\n\\n</think>`` at its end: Qwen3's template with
  ``chat_template_kwargs: {"enable_thinking": false}``): the output is all answer;
- the prompt opened the block (``<think>`` at its end: DeepSeek-R1's, Qwen3-Thinking-2507's): the
  output is thinking until ``</think>``;
- otherwise (Qwen3's template with thinking on): thinking when the output begins with ``<think>``,
  until ``</think>``; an output that begins with anything else is all answer.

A request's output constraint (``response_format``, a forced tool call) then holds after the
thinking only: the server sets its ``constraint_after`` to ``</think>`` unless the prompt closed
the block (:mod:`stagewise.engine.constraints`), as vLLM's reasoning parsers do. An output cut off
while thinking (``max_tokens``) has thinking and no answer.
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("deepseek_r1", "qwen3")
"""``--reasoning-parser`` names (vLLM's): both mark thinking with :data:`TAGS`, by the rules above."""
TAGS = ("<think>", "</think>")


@dataclass(frozen=True)
class Reasoning:
    """Where a request's thinking is: its tags, and what its prompt did with them."""

    start: str
    end: str
    opened: bool
    """The prompt opened the block: the output begins thinking."""
    closed: bool
    """The prompt closed an empty block: the output is all answer."""

    @property
    def constraint_after(self) -> str | None:
        """The text after which the request's constraint holds (None: from its first token)."""
        return None if self.closed else self.end


def reasoning_for(parser: str, prompt: str) -> Reasoning:
    """The :class:`Reasoning` of a chat whose rendered prompt is ``prompt``."""
    if parser not in PARSERS:
        raise ValueError(f"reasoning parser {parser!r} is not known; expected one of {', '.join(PARSERS)}")
    start, end = TAGS
    tail = prompt.rstrip()
    return Reasoning(start, end, opened=tail.endswith(start), closed=tail.endswith(end))


class ReasoningStream:
    """An output, fed as it comes, split into thinking and answer. Text that may still turn out
    to be a tag (or, at the start, whitespace before one) is held until it is told."""

    def __init__(self, reasoning: Reasoning) -> None:
        self.r = reasoning
        self.state = "answer" if reasoning.closed else "thinking" if reasoning.opened else "undecided"
        self.held = ""
        self.fresh = reasoning.opened
        """Whitespace at the start of the current part is dropped (after a tag, the model writes
        line breaks); an output without thinking is its answer as it is."""
        self.thought = reasoning.opened
        """Whether the output had a thinking part."""

    def feed(self, delta: str) -> tuple[str, str]:
        """(thinking, answer) of the output that may go out now."""
        self.held += delta
        thinking = answer = ""
        while True:
            if self.state == "undecided":
                head = self.held.lstrip()
                if head.startswith(self.r.start):
                    self.state, self.held, self.fresh = "thinking", head[len(self.r.start):], True
                    self.thought = True
                    continue
                if self.r.start.startswith(head):  # may be the tag still (or nothing yet)
                    return thinking, answer
                self.state = "answer"
            if self.fresh:
                self.held = self.held.lstrip()
                if not self.held:
                    return thinking, answer
                self.fresh = False
            if self.state == "answer":
                answer, self.held = answer + self.held, ""
                return thinking, answer
            at = self.held.find(self.r.end)
            if at >= 0:
                thinking += self.held[:at]
                self.state, self.held, self.fresh = "answer", self.held[at + len(self.r.end):], True
                continue
            keep = next((k for k in range(min(len(self.r.end) - 1, len(self.held)), 0, -1)
                         if self.held.endswith(self.r.end[:k])), 0)
            thinking += self.held[:len(self.held) - keep]
            self.held = self.held[len(self.held) - keep:]
            return thinking, answer

    def finish(self) -> tuple[str, str]:
        """(thinking, answer) held back when the output ended."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return held, ""
        return "", held if self.state == "answer" or held.strip() else ""


def split(reasoning: Reasoning, text: str) -> tuple[str | None, str]:
    """(thinking or None, answer) of a whole output."""
    stream = ReasoningStream(reasoning)
    parts = [stream.feed(text), stream.finish()]
    return "".join(p[0] for p in parts) if stream.thought else None, "".join(p[1] for p in parts)

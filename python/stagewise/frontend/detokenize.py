"""Streaming text out of a token stream: incremental detokenisation and stop strings.

Decoding one token at a time is wrong for real tokenizers: a character may span
several tokens (byte-fallback ``<0xE2>`` pieces, byte-level BPE pieces of an
emoji), and sentencepiece-style decoders treat the first token of a sequence
differently (its leading space is dropped). :class:`IncrementalDetokenizer`
therefore decodes a short window of recent tokens twice — the part already
emitted and the whole window — and emits the difference, so the first-token rule
applies equally to both and cancels out. Text is held back while it may still
change: while the window's text ends in U+FFFD (an unfinished character) and
while the newest token is a byte-fallback piece (tokenizers decodes a run of
byte pieces as a whole, so a later byte can turn the run into replacement
characters).

The driving loop, per request and token, looks like::

    if checker.is_stop_token(tok):          # EOS / stop ids: their own text is not output
        text, _ = checker.finish(detok.flush()); reason = "stop"
    else:
        text, reason = checker.feed(detok.push(tok))      # reason: "stop" or None
        if reason is None and out_of_tokens:
            tail, reason = checker.finish(detok.flush())  # a stop string may complete in the tail
            text, reason = text + tail, reason or "length"
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import tokenizers

__all__ = ["IncrementalDetokenizer", "StopChecker"]

_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_PROMPT_WINDOW = 6  # prompt tokens decoded with the output, for the first-token and byte rules


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, one token at a time.

    Invariant: the concatenation of every :meth:`push` and the final :meth:`flush`
    equals ``tokenizer.decode(ids)`` for the pushed ``ids``; with ``prompt_ids``
    it equals the text ``decode(prompt_ids + ids)`` adds after ``decode(prompt_ids)``.
    No piece ends inside a character.
    """

    def __init__(
        self,
        tokenizer: "tokenizers.Tokenizer",
        prompt_ids: Iterable[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._ids: list[int] = list(prompt_ids or [])
        # The window is ids[prefix:]; ids[prefix:read] has been emitted already.
        self._read = len(self._ids)
        self._prefix = self._window_start(max(0, self._read - _PROMPT_WINDOW), self._read)
        self._prefix_text = self._decode(self._prefix, self._read)

    @property
    def ids(self) -> list[int]:
        """Every token id seen, prompt first."""
        return self._ids

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes ('' while it is held back)."""
        self._ids.append(int(token_id))
        if self._ends_in_byte_run():
            return ""
        text = self._decode(self._prefix, len(self._ids))
        if text.endswith(_REPLACEMENT) or len(text) <= len(self._prefix_text):
            return ""
        if not text.startswith(self._prefix_text):
            return ""  # the window's earlier text changed; wait until it settles
        new = text[len(self._prefix_text):]
        self._advance()
        return new

    def flush(self) -> str:
        """End of stream: returns whatever is still held back."""
        text = self._decode(self._prefix, len(self._ids))
        new = text[len(self._prefix_text):] if text.startswith(self._prefix_text) else text
        self._advance()
        return new

    def _advance(self) -> None:
        """Everything up to the end is emitted: the next window starts at the old read point."""
        self._prefix = self._window_start(self._read, len(self._ids))
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)

    def _window_start(self, start: int, read: int) -> int:
        """Moves a window start back so that decoding from it matches decoding from 0.

        The window must open on a token that the decoder sees (not skipped) and that
        is not a byte-fallback piece: byte pieces decode as a run (skipped tokens in
        between do not break it), and the first token seen gets the decoder's
        first-token treatment, which must fall on text already emitted
        (``ids[start:read]``) so that it cancels out.
        """
        ids = self._ids
        while start > 0 and (start >= read or self._skipped(ids[start]) or self._is_byte_piece(ids[start])):
            start -= 1
        return start

    def _ends_in_byte_run(self) -> bool:
        """Whether the last token the decoder sees is a byte-fallback piece."""
        for token_id in reversed(self._ids):
            if not self._skipped(token_id):
                return self._is_byte_piece(token_id)
        return False

    def _decode(self, start: int, end: int) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _skipped(self, token_id: int) -> bool:
        return self._skip and token_id in self._special

    def _is_byte_piece(self, token_id: int) -> bool:
        piece = self._tok.id_to_token(token_id)
        return piece is not None and _BYTE_TOKEN.fullmatch(piece) is not None


class StopChecker:
    """Finds stop strings in a text stream and stop/EOS ids in the token stream.

    :meth:`feed` returns the text that is safe to emit: it never contains any part
    of a stop string, because a tail that could still grow into one is held back
    until the next piece settles it.
    """

    def __init__(
        self,
        stop: Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._stop = [s for s in stop]
        if not all(isinstance(s, str) and s for s in self._stop):
            raise ValueError(f"StopChecker: argument 'stop' must hold non-empty strings, got {self._stop!r}")
        self._stop_ids = frozenset(int(t) for t in stop_token_ids) | frozenset(int(t) for t in eos_token_ids)
        self._pending = ""
        self._done = False

    def is_stop_token(self, token_id: int) -> bool:
        """True for an EOS id or a stop token id (finish_reason 'stop')."""
        return int(token_id) in self._stop_ids

    def feed(self, text: str) -> tuple[str, str | None]:
        """Adds newly decoded text; returns (text to emit, 'stop' or None)."""
        if self._done:
            raise ValueError("StopChecker.feed: the stream already finished")
        buf = self._pending + text
        cut = self._first_stop(buf)
        if cut is not None:
            self._pending, self._done = "", True
            return buf[:cut], "stop"
        keep = self._partial_tail(buf)
        self._pending = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], None

    def finish(self, text: str = "") -> tuple[str, str | None]:
        """End of stream: checks ``text`` too, then releases everything held back."""
        if self._done:
            return "", None
        buf = self._pending + text
        self._pending, self._done = "", True
        cut = self._first_stop(buf)
        return (buf, None) if cut is None else (buf[:cut], "stop")

    def _first_stop(self, buf: str) -> int | None:
        """Start of the stop string that completes first in ``buf`` (earliest end, then start)."""
        best = None
        for s in self._stop:
            at = buf.find(s)
            if at >= 0 and (best is None or (at + len(s), at) < best):
                best = (at + len(s), at)
        return None if best is None else best[1]

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self._stop), default=0)
        for n in range(min(len(buf), longest - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

"""The examples of README.md and docs/*.md: fenced code blocks, and the markers that say which of
them do not run here and why.

A block runs when its fence names a shell (``bash``, ``sh``) or ``python``. A marker is an HTML
comment on the line before the fence (blank lines between are allowed), visible to anyone who
edits the page:

    <!-- example: skip — needs a GPU -->         never run here; the reason is required
    <!-- example: slow — starts 3 processes -->  run only with STAGEWISE_DOCS_SLOW=1
    <!-- example: file plan.yaml -->             not run: the block is written to the page's
                                                 scratch folder as plan.yaml, for its examples

Every fence must name its language (``text`` for diagrams and printed output), so that no example
hides from the test in an unlabelled block. Nothing here runs anything: parsing only, so that the
rules are tested on their own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SHELLS = ("bash", "sh")
LANGUAGES = (*SHELLS, "python")
KINDS = ("run", "skip", "slow", "file")
MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<body>.*?)\s*-->\s*$")
FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
_REASON = re.compile(r"^(?P<kind>skip|slow)\s*(?:—|–|:|-{1,2})\s*(?P<reason>\S.*)$")
_FILE = re.compile(r"^file\s+(?P<name>[\w.\-]+(?:/[\w.\-]+)*)$")


@dataclass(frozen=True, slots=True)
class Example:
    """One fenced block of a page."""

    doc: str
    """The page, relative to the repository root (``docs/multi-host.md``)."""
    line: int
    """Line number of the opening fence (1-based); the code starts on the next line."""
    language: str
    code: str
    kind: str = "run"
    """``run`` (an example, run), ``skip``, ``slow`` or ``file`` (see the module docstring);
    blocks of other languages without a marker are ``run`` too and :attr:`runnable` says no."""
    reason: str = ""
    file: str = ""
    """For ``file``: the name the block is written under in the scratch folder."""

    @property
    def runnable(self) -> bool:
        return self.language in LANGUAGES

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    def doc_line(self, code_line: int) -> int:
        """The page's line of the block's ``code_line``-th line (1-based)."""
        return self.line + code_line


def _marker(body: str) -> tuple[str, str, str] | str:
    """``(kind, reason, file)`` of a marker's text, or the problem with it as a string."""
    if m := _REASON.match(body):
        return m["kind"], m["reason"].strip(), ""
    if m := _FILE.match(body):
        return "file", "", m["name"]
    if body.split()[:1] in (["skip"], ["slow"]):
        return f"marker {body!r} gives no reason: write '<!-- example: {body.split()[0]} — why -->'"
    return (f"unknown marker {body!r}: expected 'skip — reason', 'slow — reason' or 'file NAME' "
            f"after 'example:'")


def parse(text: str, doc: str) -> tuple[list[Example], list[str]]:
    """The fenced blocks of one page, and the problems found (each naming ``doc:line``)."""
    lines = text.splitlines()
    examples: list[Example] = []
    problems: list[str] = []
    pending: tuple[int, tuple[str, str, str]] | None = None  # a marker waiting for its fence
    i = 0
    while i < len(lines):
        line = lines[i]
        if m := MARKER.match(line):
            if pending is not None:
                problems.append(f"{doc}:{pending[0]}: marker is not followed by a code block")
            parsed = _marker(m["body"])
            if isinstance(parsed, str):
                problems.append(f"{doc}:{i + 1}: {parsed}")
                pending = None
            else:
                pending = (i + 1, parsed)
            i += 1
            continue
        fence = FENCE.match(line)
        if fence is None:
            if line.strip() and pending is not None:
                problems.append(f"{doc}:{pending[0]}: marker is not followed by a code block")
                pending = None
            i += 1
            continue
        start, mark, language = i + 1, fence["fence"], fence["info"].lower()
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(mark[0] * len(mark))
                                      and set(lines[i].strip()) == {mark[0]}):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            problems.append(f"{doc}:{start}: code block is never closed")
        i += 1
        if not language:
            problems.append(f"{doc}:{start}: code block names no language (use 'text' for diagrams and output)")
        kind, reason, file = pending[1] if pending else ("run", "", "")
        pending = None
        if kind in ("skip", "slow") and language not in LANGUAGES:
            problems.append(f"{doc}:{start}: '{kind}' marks a {language or 'unlabelled'} block, which never runs")
        examples.append(Example(doc=doc, line=start, language=language, code="\n".join(body) + "\n",
                                kind=kind, reason=reason, file=file))
    if pending is not None:
        problems.append(f"{doc}:{pending[0]}: marker is not followed by a code block")
    return examples, problems


def collect(root: Path, pages: list[str]) -> tuple[list[Example], list[str]]:
    """Every block of the given pages (paths relative to ``root``), in page order."""
    examples: list[Example] = []
    problems: list[str] = []
    for page in pages:
        found, bad = parse((root / page).read_text(encoding="utf-8"), page)
        examples += found
        problems += bad
    return examples, problems


def pages(root: Path) -> list[str]:
    """README.md and every page of docs/, the documentation a user reads."""
    return ["README.md", *sorted(str(p.relative_to(root)) for p in (root / "docs").glob("*.md"))]

"""The documentation test's own machinery: parsing pages and markers, reporting a failure at the
page's line; and the rule that pages, help texts and messages describe what they rely on instead
of citing documents users do not have."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from helpers.doc_examples import Example, parse
from helpers.example_runner import failure, run

ROOT = Path(__file__).resolve().parents[2]

PAGE = """# Title

```bash
stagewise plan ranks --world-size 4
```

Some text.
<!-- example: skip — needs a GPU -->

```python
import torch
```

<!-- example: slow: starts three processes -->
```sh
stagewise generate smollm2-135m --stages 3
```

<!-- example: file plan.yaml -->
```yaml
model: smollm2-135m
```

```text
a diagram
```
"""


def test_blocks_markers_and_lines():
    examples, problems = parse(PAGE, "page.md")
    assert problems == []
    assert [(e.line, e.language, e.kind, e.reason, e.file) for e in examples] == [
        (3, "bash", "run", "", ""),
        (10, "python", "skip", "needs a GPU", ""),
        (15, "sh", "slow", "starts three processes", ""),
        (20, "yaml", "file", "", "plan.yaml"),
        (24, "text", "run", "", ""),
    ]
    assert examples[0].code == "stagewise plan ranks --world-size 4\n"
    assert [e.runnable for e in examples] == [True, True, True, False, False]
    assert examples[0].doc_line(1) == 4 and examples[0].where == "page.md:3"


def test_malformed_pages_are_reported_with_their_lines():
    page = ("<!-- example: skip -->\n```bash\nls\n```\n"
            "<!-- example: later -->\n```bash\nls\n```\n"
            "<!-- example: skip — a reason -->\nprose in between\n```bash\nls\n```\n"
            "```\nno language\n```\n"
            "<!-- example: slow — why -->\n```yaml\na: 1\n```\n"
            "```bash\nnever closed\n")
    _, problems = parse(page, "bad.md")
    assert problems == [
        "bad.md:1: marker 'skip' gives no reason: write '<!-- example: skip — why -->'",
        "bad.md:5: unknown marker 'later': expected 'skip — reason', 'slow — reason' or 'file NAME' after 'example:'",
        "bad.md:9: marker is not followed by a code block",
        "bad.md:14: code block names no language (use 'text' for diagrams and output)",
        "bad.md:18: 'slow' marks a yaml block, which never runs",
        "bad.md:21: code block is never closed",
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_a_failing_shell_command_is_named_with_its_page_line(tmp_path):
    example = Example(doc="docs/page.md", line=40, language="bash",
                      code="echo one\nfalse  # the culprit\necho never\n")
    outcome = run(example, tmp_path, _env(), timeout_s=30)
    message = failure(example, outcome, 30)
    assert outcome.returncode != 0 and "never" not in outcome.output
    assert message.startswith("docs/page.md:42: `false` failed (exit status 1)")
    assert "one" in message


def test_background_jobs_are_stopped_and_success_is_success(tmp_path):
    example = Example(doc="p.md", line=1, language="bash", code="sleep 60 &\necho done > out.txt\n")
    outcome = run(example, tmp_path, _env(), timeout_s=30)
    assert failure(example, outcome, 30) is None and (tmp_path / "out.txt").read_text() == "done\n"


def test_a_python_traceback_names_the_page_and_its_line(tmp_path):
    example = Example(doc="README.md", line=10, language="python", code="x = 1\nraise ValueError('bad')\n")
    message = failure(example, run(example, tmp_path, _env(), timeout_s=30), 30)
    assert message.startswith("README.md:10: the python block failed (exit status 1)")
    assert 'File "README.md", line 12' in message and "ValueError: bad" in message


def test_a_hanging_example_is_killed_and_reported(tmp_path):
    example = Example(doc="p.md", line=5, language="sh", code="sleep 30\n")
    outcome = run(example, tmp_path, _env(), timeout_s=0.5)
    assert outcome.timed_out and "did not finish within 0 s" in failure(example, outcome, 0.5)


CITATION = re.compile(r"\bseeds? 00\d|§\s*\d", re.IGNORECASE)


def test_no_page_help_text_or_message_cites_the_design_documents():
    paths = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").iterdir()]
    for top in ("python", "include", "csrc"):
        paths += [p for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".h", ".cpp", ".cu", ".md")]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in paths
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if CITATION.search(line)]
    assert not found, "describe it instead of citing a document users do not have:\n" + "\n".join(found)

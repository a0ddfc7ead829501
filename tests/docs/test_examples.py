"""Every shell and Python example of README.md and docs/*.md runs, as a reader would run it.

Each page gets a scratch folder holding a copy of ``examples/`` and the page's ``file`` blocks;
its examples run there in page order (a later one may use what an earlier one wrote), with the
project's environment first on ``PATH`` (the ``stagewise`` console script),
``STAGEWISE_BENCH_TINY=1``, which gives the benchmarks toy sizes, and one torch thread per process. Blocks marked ``skip`` are
listed with their reasons at the end of the run; ``slow`` ones run when ``STAGEWISE_DOCS_SLOW=1``.
A last test checks that no example wrote into the repository.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from helpers.doc_examples import collect, pages
from helpers.example_runner import failure, run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES, PROBLEMS = collect(ROOT, pages(ROOT))
RUN_SLOW = os.environ.get("STAGEWISE_DOCS_SLOW") == "1"
TIMEOUT_S = 1200.0 if RUN_SLOW else 300.0
# Where the examples may not write; build outputs and caches are not the documentation's business.
_UNWATCHED = {".git", ".venv", "build", "__pycache__", ".pytest_cache"}


def _files(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _UNWATCHED and not d.endswith(".egg-info")]
        for name in names:
            path = Path(folder, name)
            st = path.stat()
            out[str(path.relative_to(root))] = (st.st_mtime_ns, st.st_size)
    return out


@pytest.fixture(scope="module")
def repository_before() -> dict[str, tuple[int, int]]:
    return _files(ROOT)


@pytest.fixture(scope="module")
def environment() -> dict[str, str]:
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "stagewise").exists():
        pytest.fail(f"no `stagewise` console script beside {sys.executable}: run the tests with the project's "
                    "environment (make test)", pytrace=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEWISE_")}  # a reader's clean shell
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["STAGEWISE_BENCH_TINY"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # One torch thread per process: on a test machine shared with other work, kernels split over
    # every core wait on the busy ones (a step can take 50x longer); nothing the examples show
    # depends on the thread count.
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, repository_before):
    folders: dict[str, Path] = {}

    def folder(doc: str) -> Path:
        if doc not in folders:
            path = tmp_path_factory.mktemp(doc.replace("/", "-").removesuffix(".md"))
            shutil.copytree(ROOT / "examples", path / "examples")
            for e in EXAMPLES:
                if e.doc == doc and e.kind == "file":
                    (path / e.file).parent.mkdir(parents=True, exist_ok=True)
                    (path / e.file).write_text(e.code, encoding="utf-8")
            folders[doc] = path
        return folders[doc]

    return folder


def test_every_block_is_labelled_and_every_marker_well_formed():
    assert EXAMPLES, "found no code blocks in the documentation: the parser is broken"
    assert not PROBLEMS, "\n".join(PROBLEMS)


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.runnable], ids=lambda e: e.where)
def test_example(example, scratch, environment):
    folder = scratch(example.doc)
    if example.kind == "skip":
        pytest.skip(f"{example.where}: {example.reason}")
    if example.kind == "slow" and not RUN_SLOW:
        pytest.skip(f"{example.where}: slow, {example.reason} (STAGEWISE_DOCS_SLOW=1 runs it)")
    outcome = run(example, folder, environment, TIMEOUT_S)
    message = failure(example, outcome, TIMEOUT_S)
    if message:
        pytest.fail(message, pytrace=False)


def test_the_examples_wrote_nothing_into_the_repository(repository_before):
    after = _files(ROOT)
    changed = sorted(p for p in set(after) | set(repository_before) if after.get(p) != repository_before.get(p))
    assert not changed, f"documentation examples changed files of the repository: {changed}"

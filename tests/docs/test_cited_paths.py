"""Every repository path the documentation cites exists, and none is one machine's.

A cited path is a code span that starts with one of the repository's folders or names one
of its root files (`consumers/handling/worker.py`, `tests/integration/test_parking.py::test_x`,
`deploy/k8s/base`, `.ci/setup`, `pyproject.toml`). Spans with a placeholder (`<...>`,
`NAME`, `*`, `…`) are patterns, not paths, and are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
FOLDERS = (
    "partq",
    "producer",
    "coordinator",
    "consumers",
    "examples",
    "tests",
    "deploy",
    "benchmarks",
    "docs",
    ".ci",
)
ROOT_FILES = (
    "pyproject.toml",
    "Dockerfile",
    "MANIFEST.in",
    "mkdocs.yml",
    "README.md",
    "CHANGELOG.md",
)
_SPAN = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(
    r"^(?:(?:"
    + "|".join(re.escape(f) for f in FOLDERS)
    + r")/[\w./-]*|"
    + "|".join(re.escape(f) for f in ROOT_FILES)
    + r")$"
)
_PLACEHOLDER = re.compile(r"[<>*…{}$]|\bNAME\b|\bNNNNN\b")
_BENCHMARK = re.compile(r"(?<![\w/.])benchmarks\.(\w+)")
# A path on one engineer's machine: a clone's location, a scratch worktree, a home.
_MACHINE = re.compile(r"(?<![\w.~-])/(?:work|tmp|root|home)/")


def _module(name: str) -> str:
    package = f"benchmarks/{name}/__init__.py"
    return package if (ROOT / package).exists() else f"benchmarks/{name}.py"


def cited(text: str) -> list[str]:
    found = []
    for span in _SPAN.findall(text):
        if _PLACEHOLDER.search(span):
            continue
        path = span.split("::", 1)[0].split("#", 1)[0].split(":", 1)[0].rstrip(".,;")
        if _PATH.match(path):
            found.append(path)
        # a benchmark named as a module: python -m benchmarks.planned (a file, or a package)
        found.extend(_module(name) for name in _BENCHMARK.findall(span))
    return found


def test_cited_recognises_paths_and_skips_patterns() -> None:
    text = (
        "`consumers/handling/worker.py` `tests/x.py::test_y` `partq.NAME.p00000` "
        "`deploy/k8s/<env>` "
        "`python -m benchmarks.lag --rounds 1`"
    )
    assert cited(text) == ["consumers/handling/worker.py", "tests/x.py", "benchmarks/lag.py"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_path_exists(doc: Path) -> None:
    missing = sorted({p for p in cited(doc.read_text(encoding="utf-8")) if not (ROOT / p).exists()})
    assert not missing, f"{doc.relative_to(ROOT)} cites paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_path_of_one_machine(doc: Path) -> None:
    lines = [
        f"{number}: {line.strip()}"
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
        if _MACHINE.search(line)
    ]
    assert not lines, f"{doc.relative_to(ROOT)} names a machine's own paths: {lines}"

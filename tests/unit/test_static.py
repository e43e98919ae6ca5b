"""The repository's static gates, run by the test command so CI enforces them.

- the layering rule of docs/architecture.md (``[tool.importlinter]`` in pyproject.toml):
  imports run downward, cli > consumers > coordinator > producer > kernel;
- ``ruff check`` and ``ruff format --check`` on everything;
- ``mypy --strict`` on the packages (``[tool.mypy]``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run .ci/setup (it installs partq[dev])")
    return found


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_imports_run_downward() -> None:
    result = run(tool("lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout


def test_ruff_check_passes() -> None:
    result = run(tool("ruff"), "check", ".")
    assert result.returncode == 0, result.stdout[-3000:]


def test_ruff_format_leaves_every_file_as_it_is() -> None:
    result = run(tool("ruff"), "format", "--check", ".")
    assert result.returncode == 0, result.stdout[-3000:]


@pytest.mark.slow
def test_mypy_strict_passes() -> None:
    result = run(tool("mypy"))
    assert result.returncode == 0, result.stdout[-3000:]

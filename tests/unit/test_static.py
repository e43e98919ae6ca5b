"""The repository's static gates, run by the test command so CI enforces them.

- the layering rule of docs/architecture.md: imports inside ``partq`` run downward,
  cli > consumers > coordinator > producer > kernel, and nothing imports the examples
  or the tests;
- ``ruff check`` and ``ruff format --check`` on everything;
- ``mypy --strict`` on the packages (``[tool.mypy]``).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
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


LAYERS = ("partq.cli", "partq.consumers", "partq.coordinator", "partq.producer", "partq.kernel")


def product_modules() -> dict[str, Path]:
    """Every module of the ``partq`` package, by dotted name, from pyproject's package-dir."""
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    found: dict[str, Path] = {}
    for package, folder in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found.setdefault(name, path)
    return found


def imported(path: Path) -> set[str]:
    """The modules a file imports, anywhere in it (functions and TYPE_CHECKING included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def layer(module: str) -> int | None:
    for index, name in enumerate(LAYERS):
        if module == name or module.startswith(name + "."):
            return index
    return None


def test_imports_run_downward() -> None:
    modules = product_modules()
    assert {"partq.cli", "partq.consumers.control.daemon", "partq.kernel.errors"} <= set(modules)
    upward = []
    for module, path in sorted(modules.items()):
        own = layer(module)
        for target in sorted(imported(path)):
            if target.split(".")[0] in {"examples", "tests", "benchmarks"}:
                upward.append(f"{module} imports {target}")
            theirs = layer(target)
            if own is not None and theirs is not None and theirs < own:
                upward.append(f"{module} imports {target}")
    assert not upward, (
        "imports that run upward (cli > consumers > coordinator > producer > kernel):\n"
        + "\n".join(upward)
    )


def test_the_layering_check_sees_an_upward_import(tmp_path: Path) -> None:
    # Given a kernel module that imports the consumers
    bad = tmp_path / "bad.py"
    bad.write_text("from partq.consumers.control import daemon\n")
    # Then its import is one the check would flag
    assert layer("partq.kernel.bad") == 4
    assert all(layer(target) == 1 for target in imported(bad))


def test_ruff_check_passes() -> None:
    result = run(tool("ruff"), "check", ".")
    assert result.returncode == 0, result.stdout[-3000:]


def test_ruff_format_leaves_every_file_as_it_is() -> None:
    result = run(tool("ruff"), "format", "--check", ".")
    assert result.returncode == 0, result.stdout[-3000:]


def package_tree(where: Path) -> Path:
    """``partq`` laid out as the wheel has it, in symlinks: mypy knows no package-dir."""
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    for package, folder in sorted(folders.items()):
        target = where.joinpath(*package.split("."))
        if package == "partq":
            target.mkdir(parents=True)
            for entry in sorted((ROOT / folder).iterdir()):
                (target / entry.name).symlink_to(entry)
        else:
            target.symlink_to(ROOT / folder)
    return where


@pytest.mark.slow
def test_mypy_strict_passes(tmp_path: Path) -> None:
    tree = package_tree(tmp_path)
    result = subprocess.run(
        [
            tool("mypy"),
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / ".cache"),
            "-p",
            "partq",
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "no issues found in" in result.stdout

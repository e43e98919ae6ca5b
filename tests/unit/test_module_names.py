"""No module of partq's packages has a standard-library name.

A script run from a package's folder (``spark-submit partq/cli/spark.py``) has that folder first
on ``sys.path``: a ``partq/cli/http.py`` there hid the standard library's ``http``, and the job
died importing ``http.server``.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the folders the `partq` package is built from (pyproject's package-dir)
PACKAGES: list[str] = sorted(
    set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
            "package-dir"
        ].values()
    )
)


def module_names() -> dict[str, Path]:
    """Every module and subpackage of the packages: bare name -> file (``__init__`` and
    ``__main__`` are the package itself)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.parent.name if path.stem in {"__init__", "__main__"} else path.stem
            found.setdefault(name, path)
    return found


def test_the_packages_are_found() -> None:
    names = module_names()
    assert set(PACKAGES) <= set(names)
    assert {"spark", "web", "topology"} <= set(names)


def test_no_module_has_a_standard_library_name() -> None:
    clashes = {
        name: str(path.relative_to(ROOT))
        for name, path in module_names().items()
        if name in sys.stdlib_module_names
    }
    assert not clashes, f"modules named like the standard library's: {clashes}"


def test_cli_spark_runs_as_a_script() -> None:
    # Given the job's file run as spark-submit runs it: as a script, its folder on sys.path
    # When it is asked for its help
    result = subprocess.run(
        [sys.executable, str(ROOT / "partq" / "cli" / "spark.py"), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Then the whole CLI imported and parsed the arguments of spark-job
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Usage: partq spark-job" in result.stdout
    assert "--checkpoint" in result.stdout

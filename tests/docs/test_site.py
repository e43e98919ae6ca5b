"""The documentation site builds without a warning, and its generated pages follow the code.

`mkdocs build --strict` fails on any warning: a broken link or anchor, a page missing from
the nav, a nav entry without a page. The reference pages are generated at build time by
docs/gen_reference.py (an MkDocs hook); these tests check that it is deterministic and
that each page names everything its source defines.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "docs" / "gen_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = load_generator()


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    # Given the docs, the nav and the hook; When mkdocs builds with --strict
    result = subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        # Material's notice about a future MkDocs is not a problem of these docs
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    # Then it succeeds with no warning, and every generated page is in the site
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "WARNING" not in output, output[-5000:]
    for page in ("index", "changelog", *(uri.removesuffix(".md") for uri in gen.GENERATED)):
        assert (tmp_path / "site" / page / "index.html").exists() or page == "index", page
    assert (tmp_path / "site" / "index.html").exists()


@pytest.mark.parametrize("name", sorted(gen.GENERATED))
def test_a_generated_page_is_deterministic(name: str) -> None:
    make = gen.GENERATED[name]
    assert make() == make()


def test_the_command_reference_names_every_command() -> None:
    import click

    from partq.cli import cli

    text = gen.cli_reference()
    for path, command in gen._commands(cli, ("partq",)):
        assert f"## `{' '.join(path)}`" in text
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.opts[0] in text, (path, param.opts[0])


def test_the_settings_reference_describes_every_setting() -> None:
    from partq.kernel.settings import Settings

    text = gen.settings_reference()
    for name, field in Settings.model_fields.items():
        assert f"`PARTQ_{name.upper()}`" in text
        assert field.description, f"Settings.{name} has no description: add its docstring"


def test_the_settings_reference_shows_no_password() -> None:
    assert "guest:guest" not in gen.settings_reference()


def test_the_metrics_reference_lists_every_metric_partq_exports() -> None:
    from tests.deploy.metric_names import METRICS_MODULES, exported_families

    # Given every metrics module in the packages (a new one must be added to the generator)
    # (the top-level folders producer/, coordinator/, consumers/ are partq.producer, ...)
    found = {
        ".".join(("partq", *parts) if parts[0] != "partq" else parts)
        for package in ("partq", "producer", "coordinator", "consumers")
        for path in (ROOT / package).rglob("metrics.py")
        for parts in [path.relative_to(ROOT).with_suffix("").parts]
    }
    assert found == {name for name, _ in gen.METRIC_MODULES} == set(METRICS_MODULES)
    # Then the page lists each family with its type and labels
    listed = {name: kind for _, name, kind, _, _ in gen.metrics()}
    families = exported_families()
    assert {name.removesuffix("_total") for name in listed} == set(families)
    text = gen.metrics_reference()
    for name, kind in sorted(listed.items()):
        assert f"| `{name}` | {kind} |" in text

"""partq.__version__: the installed distribution's version, pyproject.toml its source."""

from __future__ import annotations

import importlib
import importlib.metadata

import pytest

import partq
from partq import kernel


def test_the_version_is_the_installed_distributions() -> None:
    assert partq.__version__ == kernel.__version__ == importlib.metadata.version("partq")


def test_an_uninstalled_tree_still_has_a_version(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    try:
        assert importlib.reload(kernel).__version__ == "0+unknown"
    finally:
        monkeypatch.undo()
        importlib.reload(kernel)
    assert kernel.__version__ == importlib.metadata.version("partq")

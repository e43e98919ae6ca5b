"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from partq.cli.web import serve


@pytest.fixture
def server() -> Iterator[Callable[..., str]]:
    """``server(**endpoints)``: serve on a free loopback port; the base URL."""
    started: list[Any] = []

    def start(**endpoints: Any) -> str:
        endpoints.setdefault("live", lambda: True)
        endpoints.setdefault("ready", lambda: True)
        s = serve("127.0.0.1", 0, **endpoints)
        started.append(s)
        return f"http://127.0.0.1:{s.server_port}"

    yield start
    for s in started:
        s.shutdown()
        s.server_close()

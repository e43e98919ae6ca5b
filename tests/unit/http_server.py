"""A GET that returns status, body and headers (401s and 503s included); the ``server``
fixture that serves ``partq.cli.web`` on a free loopback port is in tests/unit/conftest.py."""

from __future__ import annotations

import urllib.error
import urllib.request

__all__ = ["get"]


def get(url: str, token: str | None = None) -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)

"""Bounded polling for tests: wait for a condition, never sleep-and-hope.

Every loop is bounded in count and in time; a timeout is an AssertionError that
names what was awaited and the last value seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["eventually", "wait_until"]


def wait_until(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = ""
) -> Any:
    """Poll ``predicate`` until it is truthy (returned) or ``timeout`` passes (AssertionError)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    for _ in range(int(timeout / interval) + 2):
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what or predicate}: last {last!r}"
    )


def eventually(what: str, check: Callable[[], bool], timeout: float = 5.0) -> None:
    """:func:`wait_until` with the condition named first, polling every 10 ms."""
    wait_until(check, timeout, interval=0.01, what=what)

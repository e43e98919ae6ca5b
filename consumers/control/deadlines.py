"""The controller's deadlines: events it asked itself for later, kept in one heap.

The daemon's controller serves them from its own event loop (``Consumer._run``): it takes
its queue with a timeout until the earliest due time, then handles what has come due, in
due order (ties in the order asked), before its next take. No thread of its own: a
delayed event is no longer a ``threading.Timer`` each.

Threads. Owned by the daemon's controller thread: it alone adds (``after``) and takes
(``pop``, ``timeout``). Nothing here is thread-safe, and no other thread needs it: the
others reach the controller through its queue.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Generic, TypeVar

__all__ = ["Deadlines"]

E = TypeVar("E")


class Deadlines(Generic[E]):
    """Events due at monotonic times; the earliest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, E]] = []
        self._order = itertools.count()  # ties: in the order asked, never comparing events

    def __len__(self) -> int:
        return len(self._heap)

    def after(self, seconds: float, event: E) -> None:
        """``event`` is due ``seconds`` from now."""
        heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._order), event))

    def timeout(self, until: float | None = None) -> float | None:
        """Seconds until the earliest due time, or until ``until`` (monotonic) if that is
        earlier; None: nothing is due, ever."""
        due = self._heap[0][0] if self._heap else None
        if until is not None and (due is None or until < due):
            due = until
        return None if due is None else max(0.0, due - time.monotonic())

    def pop(self) -> E | None:
        """Take the earliest event if it is due by now; None if none is."""
        if self._heap and self._heap[0][0] <= time.monotonic():
            return heapq.heappop(self._heap)[2]
        return None

"""Per-key order inside one partition: which delivery may start now (a pure core).

A partition's deliveries arrive in publish order. With ``--concurrency`` above 1 the
messages of *different* keys run at once, but a key's own messages must never overlap
and must run in arrival order. :class:`KeyQueues` decides that and nothing else: it does
no I/O, takes the clock as an argument, and is driven by one thread (the partition's
dispatcher, ``partq.consumers.handling.keyed``).

A key is held only while it has a message running or waiting; once its last message is
done it is forgotten, so memory is bounded by the deliveries held (the prefetch window),
however many distinct keys pass.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["KeyQueues"]

T = TypeVar("T")


class KeyQueues(Generic[T]):
    """The running key set and each running key's waiting items (oldest first)."""

    def __init__(self) -> None:
        # key -> its waiting (arrived-at, item); a key is running iff it is here
        self._keys: dict[Hashable, deque[tuple[float, T]]] = {}

    def arrive(self, key: Hashable, item: T, now: float) -> T | None:
        """``item`` if it may start now (its key is idle), else None: it waits its turn."""
        waiting = self._keys.get(key)
        if waiting is None:
            self._keys[key] = deque()
            return item
        waiting.append((now, item))
        return None

    def done(self, key: Hashable) -> T | None:
        """The running item of ``key`` is finished: the key's next item to start, if any."""
        waiting = self._keys[key]  # a KeyError here is a caller's bug: nothing ran for key
        if waiting:
            return waiting.popleft()[1]
        del self._keys[key]
        return None

    def take_waiting(self) -> list[T]:
        """Every waiting item, in arrival order per key, removed (the running keys stay)."""
        items = [item for waiting in self._keys.values() for _at, item in waiting]
        for waiting in self._keys.values():
            waiting.clear()
        return items

    @property
    def running(self) -> int:
        return len(self._keys)

    @property
    def waiting(self) -> int:
        return sum(map(len, self._keys.values()))

    def longest_wait(self, now: float) -> float:
        """Seconds the longest-waiting item has waited behind its key (0: none waits)."""
        found = self.longest_waiting(now)
        return 0.0 if found is None else found[1]

    def longest_waiting(self, now: float) -> tuple[Hashable, float] | None:
        """The key whose oldest waiting item has waited longest, and for how many seconds
        (None: none waits). A scan of the held keys: call it about once a second."""
        oldest = min(((w[0][0], k) for k, w in self._keys.items() if w), default=None, key=_at)
        return None if oldest is None else (oldest[1], max(0.0, now - oldest[0]))


def _at(pair: tuple[float, Hashable]) -> float:
    return pair[0]

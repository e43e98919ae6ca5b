"""Exponential backoff: the one place partq spells "wait 0.2 s, doubling to 5 s".

:class:`Backoff` is the policy, frozen and shareable; :class:`Delays` is one retry loop's
position in it::

    delays = Backoff().delays()          # 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, ...
    while not connect():
        time.sleep(delays.next())
    delays.reset()                       # connected: the next outage starts at 0.2 s again

:meth:`Backoff.delay` answers the same question for code that already counts its attempts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Wait ``initial`` seconds, then ``factor`` times longer each time, never over ``maximum``."""

    initial: float = 0.2
    factor: float = 2.0
    maximum: float = 5.0

    def __post_init__(self) -> None:
        if self.initial < 0 or self.maximum < 0:
            raise ValueError(f"backoff delays cannot be negative: {self}")
        if self.factor < 1:
            raise ValueError(f"a backoff factor below 1 would shrink the delays: {self}")

    def delay(self, attempt: int) -> float:
        """The wait after failed attempt number ``attempt`` (1: ``initial``)."""
        if attempt < 1:
            raise ValueError(f"attempts count from 1, not {attempt}")
        try:
            return min(self.initial * self.factor ** (attempt - 1), self.maximum)
        except OverflowError:  # a loop that has retried for hours: long since at the maximum
            return self.maximum

    def delays(self) -> Delays:
        """A fresh sequence of waits for one retry loop."""
        return Delays(self)


class Delays:
    """Where one retry loop is in its :class:`Backoff`: not thread-safe, one per loop."""

    __slots__ = ("attempts", "backoff")

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff
        self.attempts = 0  # failures since the start or the last reset()

    def next(self) -> float:
        """The wait after one more failure."""
        self.attempts += 1
        return self.backoff.delay(self.attempts)

    def reset(self) -> None:
        """It worked: the next failure waits ``initial`` again."""
        self.attempts = 0

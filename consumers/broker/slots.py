"""A partition's slot on one connection, and the lines its channel goes through.

:class:`_Slot` holds, for one partition, its channel's line (:class:`_Opening`,
:class:`_Warm`, or a :class:`_Sub`: a channel and its
:class:`partq.consumers.state.window.Window`), a subscribe deferred while its queue is
missing, that queue's backoff, its ``basic.consume`` arguments and its hot standby
(:class:`_Standby`). Plain records, private to the broker's channel modules
(``partq.consumers.broker.channels``, ``.drain``, ``.hotstandby``), which change them.

Threads. No code of its own runs: the records are read and changed only on the broker's
pika I/O thread, so nothing is locked.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from partq.consumers.broker.port import Delivery
from partq.consumers.state import window as w
from partq.consumers.state.priority import Arguments
from pika.channel import Channel

from partq.kernel.backoff import Delays

__all__ = ["_Opening", "_Slot", "_Standby", "_Sub", "_Warm"]


@dataclass
class _Opening:
    """A channel opening for a subscribe."""

    generation: int


@dataclass
class _Warm:
    """A channel opening for ``warm``."""

    subscribe: int | None = None  # the generation of a subscribe asked meanwhile


@dataclass
class _Sub:
    """A channel with our prefetch: consumed on, draining, or parked (``window.phase``)."""

    channel: Channel
    window: w.Window
    generation: int = 0
    tag: str | None = None
    unacked: deque[int] = field(default_factory=deque)  # handed on, not acked: in order
    # the deliveries' pace, for the drain's quiet rule (partq.consumers.state.window.Pace): the last
    # one's monotonic time and the mean gap between them (an exponential average, 1/8 per delivery)
    last: float = field(default_factory=time.monotonic)
    gap: float = w.IDLE
    # a drain's end is reported after a round trip (``ReportDrained``): until then its
    # window is PARKED but the channel's loss is still the partition's, or that drain
    # never ends (seen in a soak: a node kill in that round trip, a partition idle 458 s)
    reporting: bool = False

    @property
    def live(self) -> bool:
        """Its channel's loss is the partition's: a live window, or a drain not yet reported."""
        return self.window.live or self.reporting

    @property
    def pace(self) -> w.Pace:
        return w.Pace(self.last, self.gap)


@dataclass
class _Standby:
    """A hot standby subscription, on its own connection: the queue's waiting consumer
    until the owner's goes. Deliveries (the broker activated it) are kept unhandled until
    the controller decides: ``promote`` (the owner died: they go to the worker), adopt it
    as the partition's subscription (the claim is ours: ``subscribe(adopt=True)``), or
    ``give_back`` (a planned move elsewhere: its connection is aborted, so that the queue
    returns them all, in order)."""

    connection: Any = None  # its own SelectConnection, on the broker's I/O loop
    channel: Channel | None = None  # None: opening
    tag: str | None = None
    buffer: list[Delivery] = field(default_factory=list)
    activated: bool = False
    returning: bool = False  # given back: its connection aborted, or to be once open
    then: Callable[[], None] | None = None  # a subscribe of the partition waiting for its close
    arguments: Arguments = None  # an heir's x-priority (partq.consumers.state.priority)


@dataclass
class _Slot:
    """Everything about one partition on this connection."""

    line: _Opening | _Warm | _Sub | None = None
    deferred: object | None = None  # the token of a subscribe waiting for its queue
    missing: tuple[float, Delays] | None = None  # its queue was NOT_FOUND: retry not before
    standby: _Standby | None = None
    returning: _Standby | None = None  # a standby being given back, until its channel closes
    arguments: Arguments = None  # basic.consume's

    def reset(self) -> None:
        """The connection is gone: only the missing queue's backoff outlives it."""
        self.line = self.deferred = self.standby = self.returning = None

    @property
    def sub(self) -> _Sub | None:
        return self.line if isinstance(self.line, _Sub) else None

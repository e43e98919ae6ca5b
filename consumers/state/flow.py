"""The stall detector's rule (pure): which owned partitions have stopped flowing?

A partition this member consumes is *stalled* when its worker has waited for a delivery
longer than the bound while its queue has messages ready: RabbitMQ is not delivering
although the worker could take more (a slow or stuck handler is not a stall: its worker
is busy, and the handler timeout covers it). Whatever the cause (credit never returned
because acks went astray, a subscription the broker no longer serves), the partition's
messages wait with nobody noticing but the lag. The daemon asks each check
(:class:`FlowWatch`) and logs a stall once, when it begins, and once when it ends.

Threads. None of its own: :class:`FlowWatch` belongs to the daemon's controller thread.
Its inputs cross before the call: ``waiting`` from the workers' ``waiting_since`` (read
by the controller, one value each), ``ready`` from passive declares on the pika I/O
thread, queued to the controller as a ``ReadyCounts`` event (``partq.consumers.broker.port``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["FlowChange", "FlowWatch"]


@dataclass(frozen=True, slots=True)
class FlowChange:
    """What one check found: partitions that began stalling (partition -> messages
    ready), those flowing again, and every partition stalled now."""

    began: Mapping[int, int]
    ended: tuple[int, ...]
    stalled: frozenset[int]


@dataclass
class FlowWatch:
    """The partitions stalled as of the last check (the controller thread's)."""

    stalled: set[int] = field(default_factory=set)

    def check(self, owned: set[int], waiting: set[int], ready: Mapping[int, int]) -> FlowChange:
        """``owned``: partitions consumed (not paused); ``waiting``: those whose worker has
        waited past the bound; ``ready``: messages ready in the queues asked about (a
        queue that did not answer is left out, and keeps its last verdict)."""
        now = {p for p in owned & waiting if ready.get(p, 0) > 0}
        unknown = {p for p in owned & waiting if p not in ready} & self.stalled
        now |= unknown
        began = {p: ready[p] for p in sorted(now - self.stalled)}
        ended = tuple(sorted(self.stalled - now))
        self.stalled = now
        return FlowChange(began, ended, frozenset(now))

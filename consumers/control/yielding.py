"""An owner's side of a planned handoff by consumer priority: yielding to the heir.

An ACTIVE partition moved to a member that hands over by priority too is not drained but
yielded (``partq.consumers.state.priority``; the heir's side is
:mod:`partq.consumers.control.takeovers`): consumed on until the heir takes the claim
over. :class:`Yielding` says whether a partition yields (:meth:`Yielding.yields`), asks
for a deadline ``YIELD_WAIT`` after a yield begins, and at that deadline drains a
partition whose heir has not taken it over while our worker waits for deliveries
(:meth:`Yielding.stop`).

Threads. None of its own: every method runs on the daemon's controller thread, which
owns the ``Partitions`` it reads (mirror, slots) and steps through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from partq.consumers.state import priority
from partq.consumers.state.handoff import Event, Holder, Phase
from partq.coordinator.leader import policy

if TYPE_CHECKING:
    from partq.consumers.control.partitions import Partitions

__all__ = ["Yielding"]

log = logging.getLogger("partq.consumer")


class Yielding:
    """Our partitions' yields to their heirs, for ``partitions`` (the module docstring).
    ``later(p, since)``: call :meth:`stop` for p, which began yielding at ``since``,
    ``YIELD_WAIT`` later."""

    def __init__(self, partitions: Partitions, later: Callable[[int, float], None]) -> None:
        self._p = partitions
        self._later = later

    def yields(self, partition: int) -> bool:
        """Whether our ACTIVE, unassigned ``partition`` is left to its heir (consumed on
        until the heir, subscribed above us, takes the claim over once the broker switched
        to it; ``partq.consumers.state.priority``) instead of drained: we hand over by
        priority, our claim is unsealed, and the assignment names a live member that does
        too."""
        p = self._p
        claim = p.mirror.claims.get(partition)
        owner = p.mirror.assignment.get(partition)
        heir = p.mirror.members.get(owner) if owner and owner != p.member else None
        return (
            p.priority
            and not p.leaving
            and p.claims.holder(partition) is Holder.ME
            and claim is not None
            and not claim.sealed
            and claim.priority < priority.MAX_PRIORITY
            and heir is not None
            and heir.priority
            and not heir.leaving
            and heir.lease != 0
            and not policy.paused(p.mirror.requests, partition)
        )

    def began(self, partition: int) -> None:
        """``partition`` began yielding (its slot noted when): check on it later."""
        self._later(partition, self._p.slots[partition].yielded_at)

    def stop(self, partition: int, since: float) -> None:
        """``YIELD_WAIT`` after ``partition`` yielded at ``since``: drain it if its heir has
        not taken it over yet and our worker has waited for a delivery for a while. On an
        idle queue the broker switches to the heir at once but silently (no delivery comes
        to prove it), so the claim would never move. While the worker still handles what
        it was sent, wait on: the broker switches once that is settled. Sealed first, as
        every cancel."""
        slot = self._p.slots[partition]
        if slot.state.phase is not Phase.YIELDING or slot.yielded_at != since:
            return
        waiting = slot.worker.waiting_since if slot.worker is not None else 0.0
        if waiting is None or time.monotonic() - waiting < priority.IDLE_BEFORE_DRAIN:
            # still handling what it was sent: the broker switches once it is settled, and
            # a cancel now would activate the heir beside it (which must then give back)
            self._later(partition, since)
            return
        log.info("partition %d: idle, and its heir has not taken it over: draining", partition)
        self._p.feed(partition, Event.UNASSIGNED)

"""What one coordinator saw happen to a stream lately, for the live console (status page).

Bounded, in memory, per process: rebalances (when, why, how many partitions changed
owner), handoffs (a claim released by one member, then taken by another: the *claim gap*
between the two, as this coordinator's watch saw them, 0 for a claim handed over in one
put; the consumer's own
``partq_consumer_handoff_gap_seconds`` adds its subscribe time), and the depth of each
partition queue at the last two page loads, for a rate. Every coordinator records, led
or not: a standby coordinator's page shows the same history.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from partq.coordinator.store.codec import Claim

__all__ = ["Entry", "History"]


@dataclass(frozen=True, slots=True)
class Entry:
    at: float  # Unix time
    kind: str  # "rebalance" or "handoff"
    detail: str
    partition: int | None = None
    gap: float | None = None  # seconds from release to the next claim (handoffs)


class History:
    def __init__(self, limit: int = 200) -> None:
        self._lock = threading.Lock()
        self._entries: collections.deque[Entry] = collections.deque(maxlen=limit)
        self._released: dict[int, tuple[str, float]] = {}  # partition -> (member, when)
        self._holders: dict[int, str] = {}
        self._depths: dict[int, tuple[float, int]] = {}
        self._rates: dict[int, float] = {}

    def rebalanced(self, reason: str, changed: int, at: float | None = None) -> None:
        with self._lock:
            self._entries.append(
                Entry(at or time.time(), "rebalance", f"{reason}: {changed} partitions")
            )

    def seed(self, holders: dict[int, str]) -> None:
        """Who holds each partition now (a fresh snapshot), before the watch goes on."""
        with self._lock:
            self._holders.update(holders)

    def claim(self, partition: int, claim: Claim | None, at: float | None = None) -> None:
        """A claim event of the watch: a release (None) or a claim by a member."""
        now = at or time.time()
        with self._lock:
            holder = self._holders.get(partition)
            if claim is None:
                if holder is not None:
                    self._released[partition] = (holder, now)
                self._holders.pop(partition, None)
                return
            if claim.member == holder:
                return
            self._holders[partition] = claim.member
            released = self._released.pop(partition, None)
            if claim.takeover:
                detail = f"{claim.taken_from or '?'} → {claim.member} (hot standby takeover)"
                self._entries.append(Entry(now, "handoff", detail, partition))
            elif released is not None:
                source, when = released
                self._entries.append(
                    Entry(now, "handoff", f"{source} → {claim.member}", partition, now - when)
                )
            elif holder is not None:  # one put: the old owner handed its claim over
                detail = f"{holder} → {claim.member} (handed over)"
                self._entries.append(Entry(now, "handoff", detail, partition, 0.0))

    def depths(self, depths: dict[int, int], at: float | None = None) -> dict[int, float]:
        """Record the partition queues' depths now: each one's change per second since the
        previous sample at least a second ago (negative: it is draining)."""
        now = at or time.monotonic()
        with self._lock:
            for partition, messages in depths.items():
                before = self._depths.get(partition)
                if before is None or now - before[0] >= 1.0:
                    if before is not None:
                        self._rates[partition] = (messages - before[1]) / (now - before[0])
                    self._depths[partition] = (now, messages)
            return dict(self._rates)

    def entries(self, limit: int = 30) -> list[Entry]:
        """The latest ``limit`` entries, newest first."""
        with self._lock:
            return list(reversed(self._entries))[:limit]

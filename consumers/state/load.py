"""What a member handled per partition since its last load report (messages per second).

The daemon puts the result in etcd every ``ConsumerConfig.load_report`` seconds
(:meth:`partq.coordinator.store.group.Group.report_load`): the leader's lag-aware assignment
(``partq coordinator --balance load``, :mod:`partq.coordinator.leader.loads`) and the status page
read it. Each partition's worker counts what it handled; a partition that got a new
worker since the last report (it moved away and back) counts from that worker's zero.

Threads. A :class:`LoadMeter` belongs to the daemon's controller thread
(``partq.consumers.control.reports``);
it reads each worker's ``handled``, a single int the worker's thread writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

__all__ = ["LoadMeter"]


class LoadMeter:
    """Turns the workers' running counts into rates between two calls of :meth:`rates`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._at = clock()
        self._seen: dict[int, tuple[object, int]] = {}  # partition -> (worker, its count)

    def rates(self, counts: Mapping[int, tuple[object, int]]) -> tuple[dict[int, float], float]:
        """``counts``: partition -> (its worker, what that worker handled so far). Returns
        the messages handled per second since the previous call, and the seconds that were."""
        now = self._clock()
        elapsed = now - self._at
        self._at = now
        rates: dict[int, float] = {}
        for partition, (worker, count) in sorted(counts.items()):
            before = self._seen.get(partition)
            since = count - before[1] if before is not None and before[0] is worker else count
            if elapsed > 0:
                rates[partition] = max(0, since) / elapsed
        self._seen = dict(counts)
        return rates, elapsed

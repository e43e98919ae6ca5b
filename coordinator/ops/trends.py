"""The last 15 minutes of a stream, for the status page's charts: queue depth and handled
rate per partition and per member, sampled by the coordinator process every few seconds.

Memory is bounded: a ring of at most ``window / every + 1`` samples, each holding at most
``max_partitions`` partitions (the first ones; a wider stream's partitions are summed in the
member series, which are always whole) and one value per member. A sample closer than
``every`` seconds to the previous one is dropped, so page loads may record too.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Sample", "Trends", "sample_of"]

WINDOW = 900.0  # seconds the charts show
EVERY = 5.0  # seconds between samples at least
MAX_PARTITIONS = 64  # partitions drawn one line each at most


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # Unix time
    partition_depth: Mapping[int, int]
    partition_handled: Mapping[int, float]
    member_depth: Mapping[str, int]
    member_handled: Mapping[str, float]


def sample_of(report: Mapping[str, Any], at: float, max_partitions: int = MAX_PARTITIONS) -> Sample:
    """A sample from a :func:`partq.coordinator.ops.status.snapshot_status` report: each member's
    depth
    is the sum of its partitions' queues; a value the report lacks is left out."""
    member_depth: dict[str, int] = {}
    partition_depth: dict[int, int] = {}
    partition_handled: dict[int, float] = {}
    for row in report["rows"]:
        p, messages, owner = row["partition"], row["messages"], row["owner"]
        if messages is not None and owner is not None:
            member_depth[owner] = member_depth.get(owner, 0) + messages
        if p >= max_partitions:
            continue
        if messages is not None:
            partition_depth[p] = messages
        if row.get("handled_per_s") is not None:
            partition_handled[p] = row["handled_per_s"]
    member_handled = {
        m["id"]: m["handled_per_s"] for m in report["members"] if m.get("handled_per_s") is not None
    }
    for m in report["members"]:
        member_depth.setdefault(m["id"], 0)
    return Sample(at, partition_depth, partition_handled, member_depth, member_handled)


class Trends:
    """A thread-safe ring of :class:`Sample` (the sampling loop writes, page loads read)."""

    def __init__(self, window: float = WINDOW, every: float = EVERY) -> None:
        self.window = window
        self.every = every
        self._lock = threading.Lock()
        self._samples: collections.deque[Sample] = collections.deque(maxlen=int(window / every) + 1)

    def due(self, at: float) -> bool:
        """Whether a sample at ``at`` would be kept (saves building one that would not)."""
        with self._lock:
            return not self._samples or at - self._samples[-1].at >= self.every

    def record(self, sample: Sample) -> None:
        with self._lock:
            if not self._samples or sample.at - self._samples[-1].at >= self.every:
                self._samples.append(sample)

    def samples(self, now: float) -> list[Sample]:
        """The samples of the last ``window`` seconds, oldest first."""
        with self._lock:
            return [s for s in self._samples if now - s.at <= self.window]

"""What the coordinator's and the consumer daemon's loops react to, besides watch events
(:class:`partq.coordinator.store.group.WatchEvent`): typed values, matched with ``match``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LeaseLost", "LoadTick", "Settled", "Stop", "WatchFailed"]


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop on request (``stop()``, a signal)."""


@dataclass(frozen=True, slots=True)
class LeaseLost:
    """etcd says our session's lease is gone (expired or revoked): others may take over.
    ``lease``: which one (0: unknown), so that a session's loss reported after it was
    replaced fences nothing of the next one."""

    lease: int = 0


@dataclass(frozen=True, slots=True)
class WatchFailed:
    """The watch ended (etcd restarted or unreachable): what we mirror may be stale."""

    error: Exception


@dataclass(frozen=True, slots=True)
class Settled:
    """The coordinator's settle timer ran out with no other event."""


@dataclass(frozen=True, slots=True)
class LoadTick:
    """Time to measure the partitions' loads and rebalance by them (``--balance load``)."""

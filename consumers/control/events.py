"""The consumer daemon's events: what its controller thread reacts to, typed, matched with
``match``. Besides these: :class:`partq.coordinator.store.events.Stop`, ``LeaseLost`` and
``WatchFailed``,
the group's :class:`partq.coordinator.store.group.WatchEvent`, and the broker's events
(``partq.consumers.broker.port``) other than deliveries, which go to the workers."""

from __future__ import annotations

from dataclasses import dataclass

from partq.consumers.broker.port import BrokerUpdate
from partq.coordinator.store.events import LeaseLost, Stop, WatchFailed
from partq.coordinator.store.group import WatchEvent

__all__ = [
    "BrokerOutage",
    "CheckFlow",
    "CheckLeader",
    "CheckTakeovers",
    "ControllerEvent",
    "GroupEvent",
    "LeaveNow",
    "ParkStall",
    "ReportLoad",
    "Resync",
    "RetryRelease",
    "SettleTakeover",
    "StopYielding",
    "TimerEvent",
    "WorkerFailed",
]


@dataclass(frozen=True, slots=True)
class BrokerOutage:
    """The outage limit passed since RabbitMQ became unusable (the ``outage``-th time)."""

    outage: int


@dataclass(frozen=True, slots=True)
class ParkStall:
    """A partition began or ended waiting for a message to be parked (``/readyz``)."""


@dataclass(frozen=True, slots=True)
class Resync:
    """Read the group from etcd again (after a failed watch or etcd call)."""


@dataclass(frozen=True, slots=True)
class RetryRelease:
    """Try again to release a claim (etcd was away)."""

    partition: int


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """A partition's worker stopped for good (``reason``: ``partq.consumers.handling.worker.CRASH``
    or
    ``HANDLER_TIMEOUT``)."""

    partition: int
    reason: str


@dataclass(frozen=True, slots=True)
class CheckTakeovers:
    """Decide, with one read of etcd, for every standby activated until now."""


@dataclass(frozen=True, slots=True)
class SettleTakeover:
    """A lease TTL after a takeover: make the takeover claim an ordinary one."""

    partition: int


@dataclass(frozen=True, slots=True)
class StopYielding:
    """A partition has yielded to its heir (``partq.consumers.state.priority``) for ``YIELD_WAIT``:
    if
    the heir has still not taken it over (an idle queue: the broker switched, silently, but
    no delivery proves it), drain it; ``since`` tells this yield from a later one."""

    partition: int
    since: float


@dataclass(frozen=True, slots=True)
class CheckFlow:
    """Time to look for stalled partitions (``partq.consumers.state.flow``)."""


@dataclass(frozen=True, slots=True)
class LeaveNow:
    """A stop was announced a while ago: leave the group now, whatever is still ours."""


@dataclass(frozen=True, slots=True)
class ReportLoad:
    """Time to put this member's load report (``ConsumerConfig.load_report``)."""


@dataclass(frozen=True, slots=True)
class CheckLeader:
    """A while after joining with the session ``lease``: does a coordinator lead the stream?"""

    lease: int


# What the controller asked itself to do later (a timer's event)
TimerEvent = (
    CheckLeader
    | SettleTakeover
    | StopYielding
    | LeaveNow
    | ReportLoad
    | CheckFlow
    | BrokerOutage
    | Resync
    | RetryRelease
)

# The group's, the session's and the workers' events
GroupEvent = Stop | LeaseLost | WatchFailed | WatchEvent | WorkerFailed | ParkStall | CheckTakeovers

ControllerEvent = BrokerUpdate | TimerEvent | GroupEvent

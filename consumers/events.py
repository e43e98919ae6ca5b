"""The consumer daemon's events: what its controller thread reacts to, typed, matched with
``match``. Besides these: :class:`coordinator.events.Stop`, ``LeaseLost`` and ``WatchFailed``,
and the group's :class:`coordinator.group.WatchEvent`."""

from __future__ import annotations

from dataclasses import dataclass

from consumers.handoff import Event
from coordinator.events import LeaseLost, Stop, WatchFailed
from coordinator.group import WatchEvent

__all__ = [
    "BrokerConnection",
    "BrokerOutage",
    "BrokerRefused",
    "CheckFlow",
    "CheckLeader",
    "CheckTakeovers",
    "ControllerEvent",
    "FlowReady",
    "Handoff",
    "LeaveNow",
    "ParkStall",
    "ReportLoad",
    "Resync",
    "RetryRelease",
    "SettleTakeover",
    "Standby",
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
class Handoff:
    """The broker on one partition: subscribed, drained, or its channel lost."""

    partition: int
    event: Event


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """A partition's worker stopped for good (``reason``: ``consumers.worker.CRASH`` or
    ``HANDLER_TIMEOUT``)."""

    partition: int
    reason: str


@dataclass(frozen=True, slots=True)
class Standby:
    """Our hot standby subscription of a partition was activated, or lost."""

    partition: int
    activated: bool


@dataclass(frozen=True, slots=True)
class CheckTakeovers:
    """Decide, with one read of etcd, for every standby activated until now."""


@dataclass(frozen=True, slots=True)
class SettleTakeover:
    """A lease TTL after a takeover: make the takeover claim an ordinary one."""

    partition: int


@dataclass(frozen=True, slots=True)
class CheckFlow:
    """Time to look for stalled partitions (``consumers.flow``)."""


@dataclass(frozen=True, slots=True)
class FlowReady:
    """RabbitMQ's count of messages ready in the queues of partitions whose workers wait."""

    ready: dict[int, int]


@dataclass(frozen=True, slots=True)
class LeaveNow:
    """A stop was announced a while ago: leave the group now, whatever is still ours."""


@dataclass(frozen=True, slots=True)
class ReportLoad:
    """Time to put this member's load report (``ConsumerConfig.load_report``)."""


@dataclass(frozen=True, slots=True)
class BrokerRefused:
    """RabbitMQ refused this user a partition's queue (403); ``reason``: one line saying
    which queue, which user and what to grant."""

    partition: int
    reason: str


@dataclass(frozen=True, slots=True)
class BrokerConnection:
    """The connection to RabbitMQ became usable (a channel took our prefetch) or went down."""

    up: bool


@dataclass(frozen=True, slots=True)
class CheckLeader:
    """A while after joining with the session ``lease``: does a coordinator lead the stream?"""

    lease: int


ControllerEvent = (
    Stop
    | LeaseLost
    | WatchFailed
    | WatchEvent
    | Resync
    | RetryRelease
    | Handoff
    | WorkerFailed
    | BrokerConnection
    | BrokerOutage
    | ParkStall
    | LeaveNow
    | Standby
    | SettleTakeover
    | CheckTakeovers
    | CheckFlow
    | FlowReady
    | BrokerRefused
    | ReportLoad
    | CheckLeader
)

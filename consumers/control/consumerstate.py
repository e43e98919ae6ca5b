"""What a consumer's parts share: the attributes and steps of
:class:`partq.consumers.control.daemon.Consumer` its base classes use
(:mod:`~partq.consumers.control.brokerlink`, :mod:`~partq.consumers.control.streamlife`,
:mod:`~partq.consumers.control.stopping`), declared once for them. Nothing here runs.

Threads. As the consumer's: every attribute is the daemon's controller thread's alone,
``ready`` aside (a ``threading.Event``, also read by the HTTP server thread).
"""

from __future__ import annotations

import threading

from partq.consumers.broker.port import BrokerPort
from partq.consumers.control.config import ConsumerConfig
from partq.consumers.control.events import Resync, RetryRelease, TimerEvent
from partq.consumers.control.membership import Membership
from partq.consumers.control.partitions import Partitions
from partq.consumers.control.resizing import ResizeGate
from partq.producer.contract import StreamSpec

__all__ = ["ConsumerState"]


class ConsumerState:
    """The consumer's attributes and steps its parts use (the module docstring)."""

    spec: StreamSpec  # the widest count seen (a resize's retired partitions included)
    epoch: int  # the layout's
    config: ConsumerConfig
    broker: BrokerPort
    partitions: Partitions
    membership: Membership
    resize: ResizeGate
    ready: threading.Event
    stopping: bool
    deleted: bool  # the stream is gone; waiting for it to be created again
    # Not in the group for want of a usable broker: before RabbitMQ first worked, and
    # after it was unusable for the outage limit. Joins (again) once it works.
    away: bool
    _broker_up: bool
    _outages: int  # broker losses so far: a BrokerOutage of an earlier one is stale
    exit_code: int | None  # set by a failure: run() returns it
    _deadline: float | None  # the drain's, once stopping

    def owned(self) -> list[int]:
        raise NotImplementedError

    def _after(self, seconds: float, event: TimerEvent) -> None:
        raise NotImplementedError

    def _schedule(self, event: Resync | RetryRelease) -> None:
        raise NotImplementedError

    def _join(self) -> None:
        raise NotImplementedError

    def _join_when_usable(self) -> None:
        raise NotImplementedError

    def _update_ready(self) -> None:
        raise NotImplementedError

    def _fail(self, code: int, why: str) -> None:
        raise NotImplementedError

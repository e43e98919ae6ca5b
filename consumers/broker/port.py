"""The consumer's broker port: what the controller and the workers ask of RabbitMQ, and the
one typed event sink through which the broker answers.

:class:`BrokerPort` is the surface; :class:`partq.consumers.broker.connection.Broker` implements it
over
RabbitMQ and :class:`tests.fakes.broker.StubBroker` without a server. A
:class:`BrokerFactory` makes one, given the :data:`Sink` that every :data:`BrokerEvent`
goes to: deliveries and END for the partitions' workers, and the rest for the controller.

Every :class:`Delivery` and :class:`End` carries the *generation* of the subscription it
came from: the number the controller gave ``subscribe`` or ``promote`` for the worker it
started then. The daemon routes an item to a partition's worker only if the generations
match, so an item of an earlier subscription (a fenced connection's, a parked channel's
previous consumer's) never reaches a newer worker.

Threads. The port's methods are thread-safe (the controller and the workers call them);
the sink is called on the broker's I/O thread (and, for a ``ChannelLost`` when a method
finds no connection, on the caller's): it must only hand the event on (a queue, an inbox).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pika
from partq.producer.contract import StreamSpec
from pika.channel import Channel

from partq.kernel.amqp import AmqpURL

__all__ = [
    "END",
    "Activated",
    "BrokerEvent",
    "BrokerFactory",
    "BrokerPort",
    "BrokerUpdate",
    "ChannelLost",
    "Connection",
    "Delivery",
    "Drained",
    "Emptied",
    "End",
    "Kept",
    "ReadyCounts",
    "Refused",
    "Sink",
    "StandbyLost",
    "Subscribed",
]

END = object()  # a worker's inbox item ``(END, channel)``: the last delivery came before it


@dataclass(frozen=True, slots=True)
class Delivery:
    partition: int
    channel: Channel
    delivery_tag: int
    redelivered: bool
    properties: pika.BasicProperties
    body: bytes
    generation: int = 0  # of the subscription it came from
    # as published: its layout's epoch (``partq.producer.layout.parse_routing_key``), or a fence's
    routing_key: str = ""
    exchange: str = (
        ""  # as published: the dead-letter exchange's is a filler (partq.consumers.broker.fillers)
    )

    @classmethod
    def of(
        cls,
        partition: int,
        channel: Channel,
        method: Any,
        header_frame: Any,
        body: bytes,
        generation: int,
    ) -> Delivery:
        """From pika's Basic.Deliver, content header and body."""
        return cls(
            partition,
            channel,
            method.delivery_tag,
            method.redelivered,
            header_frame.properties,
            body,
            generation,
            method.routing_key,
            method.exchange,
        )


@dataclass(frozen=True, slots=True)
class End:
    """A cancelled subscription's last delivery has been given: its worker finishes."""

    partition: int
    channel: Channel
    generation: int


@dataclass(frozen=True, slots=True)
class Subscribed:
    """``basic.consume-ok``: the partition is consumed."""

    partition: int


@dataclass(frozen=True, slots=True)
class Drained:
    """The drain is done: every delivery handled and acked, the consumer cancelled."""

    partition: int


@dataclass(frozen=True, slots=True)
class Emptied:
    """Draining: the window is full and every delivery handled; ``cut`` comes next."""

    partition: int


@dataclass(frozen=True, slots=True)
class Kept:
    """``resume`` called the drain off before its cancel: its held acks were sent."""

    partition: int


@dataclass(frozen=True, slots=True)
class ChannelLost:
    """The partition's channel (or the connection) closed: what was unacked is requeued."""

    partition: int


@dataclass(frozen=True, slots=True)
class Refused:
    """RabbitMQ refused this user the partition's queue (403 ACCESS_REFUSED); ``reason``
    is one line naming the queue, the user and the permission to grant. The partition is
    not subscribed again: retrying cannot help until the permission is granted."""

    partition: int
    reason: str


@dataclass(frozen=True, slots=True)
class Connection:
    """The connection became usable (a channel took our prefetch), or went down."""

    up: bool


@dataclass(frozen=True, slots=True)
class Activated:
    """RabbitMQ activated our hot standby subscription: its owner's consumer is gone."""

    partition: int


@dataclass(frozen=True, slots=True)
class StandbyLost:
    """Our standby subscription's channel (or connection) went."""

    partition: int


@dataclass(frozen=True, slots=True)
class ReadyCounts:
    """The answer to ``ready``: messages ready in each asked partition's queue."""

    ready: dict[int, int]


# What the broker tells the controller (deliveries and END go to the workers)
BrokerUpdate = (
    Subscribed
    | Drained
    | Emptied
    | Kept
    | ChannelLost
    | Refused
    | Connection
    | Activated
    | StandbyLost
    | ReadyCounts
)
BrokerEvent = Delivery | End | BrokerUpdate
Sink = Callable[[BrokerEvent], None]


class BrokerPort(Protocol):
    """One connection's partitions (:class:`partq.consumers.broker.connection.Broker` says how)."""

    connected: threading.Event  # set while the connection is usable
    server_version: str  # RabbitMQ's, as the last connection reported it ("" before one)

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def subscribe(
        self, partition: int, generation: int, priority: int | None = None, *, adopt: bool = False
    ) -> bool:
        """Consume ``partition`` for its worker of ``generation``; False while disconnected
        (call again on reconnect). ``Subscribed`` follows. ``priority``: the consumer's
        ``x-priority`` (``partq.consumers.state.priority``; None: none). ``adopt``: make the
        partition's
        standby subscription this one, where it is subscribed at that priority (it keeps its
        place in the queue's line; what it was sent goes to the worker), instead of giving it
        back and subscribing anew."""
        ...

    def warm(self, partition: int) -> None:
        """Open the partition's channel now, so that ``subscribe`` costs one round trip."""
        ...

    def cancel(self, partition: int, *, waiting: bool = False) -> None:
        """Begin draining: ``End`` after the last delivery (or ``Emptied``); ``waiting``:
        another's consumer is the active one, so cancel at once if nothing it was sent is
        unsettled."""
        ...

    def resume(self, partition: int) -> None:
        """Call a drain off if its cancel is not sent yet (``Kept``)."""
        ...

    def cut(self, partition: int) -> None:
        """After ``Emptied``: cancel, send the held acks, ``Drained``."""
        ...

    def ack(self, partition: int, channel: Channel, delivery_tag: int) -> None: ...

    def close_channel(self, partition: int, channel: Channel) -> None:
        """A worker left a delivery unhandled: close its channel (the broker requeues it)."""
        ...

    def finish(self, partition: int, channel: Channel) -> None:
        """The worker handled everything up to END: the held acks go, then ``Drained``."""
        ...

    def stand_by(self, partition: int, priority: int | None = None) -> bool:
        """Subscribe as the partition's hot standby (``Activated`` if its owner goes), or
        as its heir with ``priority`` (``Activated`` once the broker switches to it)."""
        ...

    def stand_down(self, partition: int) -> None: ...

    def promote(self, partition: int, generation: int) -> None:
        """The activated standby becomes the subscription of the worker of ``generation``."""
        ...

    def give_back(self, partition: int) -> None:
        """Return the activated standby's deliveries in order, then cancel it."""
        ...

    def ready(self, partitions: list[int]) -> None:
        """Count the messages ready in ``partitions``' queues (``ReadyCounts``)."""
        ...

    def fence(self) -> None:
        """Our lease is gone: drop the connection and every partition on it, silently."""
        ...

    def widen(self, spec: StreamSpec) -> None:
        """A resize added partitions: their queues may be consumed from now on."""
        ...


class BrokerFactory(Protocol):
    def __call__(
        self,
        url: AmqpURL,
        spec: StreamSpec,
        *,
        prefetch: int,
        heartbeat: int,
        name: str,
        sink: Sink,
        early_release: bool,
    ) -> BrokerPort:
        """``early_release``: report ``Emptied`` (quorum queues: the next owner may wait at
        the broker behind us) instead of cancelling a full window at once."""
        ...

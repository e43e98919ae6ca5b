"""A stub of the consumer's RabbitMQ edge, for unit tests: no server, events you drive.

:class:`StubBroker` implements :class:`partq.consumers.broker.port.BrokerPort` and is a
:class:`partq.consumers.broker.port.BrokerFactory` (``Consumer(..., broker=StubBroker)``), and it
records what the daemon and the partition workers ask of it. By default it answers
as a healthy broker does, at once: ``subscribe`` is confirmed (``Subscribed``),
``cancel`` sends the partition's worker its END mark (after whatever was delivered),
and the worker's ``finish`` reports the partition drained (``Drained``). With
``auto=False`` a test answers itself: :meth:`confirm`, :meth:`end`, :meth:`empty`
(the drain proved nothing is left: the daemon releases, then calls ``cut``), or
:meth:`keep` (a drain called off by ``resume``). A test also
delivers messages (:meth:`publish`), closes a channel (:meth:`lose_channel`) and drops
or restores the connection (:meth:`disconnect`, :meth:`reconnect`).

Threads. Every method is thread-safe (one lock): the daemon's controller, its workers and
the test call it; the sink is called on the caller's thread.

tests/unit/test_consumer_daemon.py uses it; the real broker is proven against
RabbitMQ by tests/integration/test_broker_drain.py and the group tests.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, cast

import pika
from partq.consumers.broker.port import (
    BrokerFactory,
    ChannelLost,
    Connection,
    Delivery,
    Drained,
    Emptied,
    End,
    Kept,
    ReadyCounts,
    Refused,
    Sink,
    Subscribed,
)
from partq.consumers.state.priority import consume_arguments
from partq.producer.contract import StreamSpec
from pika.channel import Channel

from partq.kernel.amqp import AmqpURL

__all__ = ["StubBroker", "StubChannel"]


@dataclass(eq=False)
class StubChannel:
    """A partition's channel: open until the stub closes it."""

    partition: int
    is_open: bool = True


class StubBroker:
    """:class:`partq.consumers.broker.port.BrokerPort` without RabbitMQ (the module docstring).
    Thread-safe."""

    def __init__(
        self,
        url: AmqpURL,
        spec: StreamSpec,
        *,
        prefetch: int,
        heartbeat: int,
        name: str,
        sink: Sink,
        early_release: bool = False,
        auto: bool = True,
    ) -> None:
        self.spec = spec
        self.prefetch = prefetch
        self.early_release = early_release
        self.auto = auto
        self.sink = sink
        self.connected = threading.Event()
        self.server_version = ""  # RabbitMQ's: a test sets "4.0.5" for handoffs by priority
        self.stopped = threading.Event()
        self.calls: list[tuple[str, int]] = []  # ("subscribe", p), ("cancel", p), ...
        self.channels: dict[int, StubChannel] = {}  # the partitions subscribed now
        self.generations: dict[int, int] = {}  # of each partition's latest subscription
        self.priorities: dict[int, int | None] = {}  # of each latest subscription or standby
        self._acked: dict[int, list[int]] = {}
        self._ended: set[int] = set()  # cancels done (END sent): too late to resume
        self._lock = threading.Lock()
        self._tags = itertools.count(1)

    # -- what the daemon and the workers call --------------------------------------------

    def start(self) -> None:
        self.reconnect()

    def join(self, timeout: float | None = None) -> None:
        pass

    def stand_by(self, partition: int, priority: int | None = None) -> bool:
        """The stub has no waiting consumers: standing by is recorded, never activated."""
        consume_arguments(priority)
        with self._lock:
            self.priorities[partition] = priority
            self.calls.append(("stand_by", partition))
        return True

    def stand_down(self, partition: int) -> None:
        with self._lock:
            self.calls.append(("stand_down", partition))

    def give_back(self, partition: int) -> None:
        with self._lock:
            self.calls.append(("give_back", partition))

    def subscribe(
        self, partition: int, generation: int, priority: int | None = None, *, adopt: bool = False
    ) -> bool:
        consume_arguments(priority)  # a bad priority fails as on the real broker
        self._record("adopt" if adopt else "subscribe", partition)
        with self._lock:
            self.priorities[partition] = priority
        if not self.connected.is_set():
            return False
        with self._lock:
            self.channels[partition] = StubChannel(partition)
            self.generations[partition] = generation
            self._ended.discard(partition)
        if self.auto:
            self.confirm(partition)
        return True

    def cancel(self, partition: int, *, waiting: bool = False) -> None:
        self._record("cancel", partition)
        with self._lock:
            subscribed = partition in self.channels
        if not subscribed:
            self.sink(ChannelLost(partition))
        elif self.auto:
            self.end(partition)

    def resume(self, partition: int) -> None:
        """A drain called off: kept at once while subscribed (a test that ended the cancel
        with :meth:`end` first gets nothing, as from a broker that sent it)."""
        self._record("resume", partition)
        with self._lock:
            kept = partition in self.channels and partition not in self._ended
        if kept and self.auto:
            self.sink(Kept(partition))

    def warm(self, partition: int) -> None:
        self._record("warm", partition)

    def ready(self, partitions: list[int]) -> None:
        """Every queue empty (the stub keeps no queues)."""
        self.sink(ReadyCounts(dict.fromkeys(partitions, 0)))

    def cut(self, partition: int) -> None:
        """After :meth:`empty`: the cancel, the held acks, then drained (at once)."""
        self._record("cut", partition)
        with self._lock:
            channel = self.channels.pop(partition, None)
        self.sink(ChannelLost(partition) if channel is None else Drained(partition))

    def ack(self, partition: int, channel: Channel, delivery_tag: int) -> None:
        if channel.is_open:  # on a closed one the broker has requeued the delivery already
            with self._lock:
                self._acked.setdefault(partition, []).append(delivery_tag)

    def close_channel(self, partition: int, channel: Channel) -> None:
        self._record("close_channel", partition)

    def finish(self, partition: int, channel: Channel) -> None:
        self._record("finish", partition)
        with self._lock:
            current = self.channels.get(partition)
            done = current is channel and current.is_open
            if done:
                del self.channels[partition]
        self.sink(Drained(partition) if done else ChannelLost(partition))

    def fence(self) -> None:
        self._record("fence", -1)
        with self._lock:
            for channel in self.channels.values():
                channel.is_open = False
            self.channels.clear()

    def promote(self, partition: int, generation: int) -> None:
        """The stub never activates a standby: nothing to promote."""
        self._record("promote", partition)
        self.sink(ChannelLost(partition))

    def stop(self) -> None:
        self._record("stop", -1)
        self.stopped.set()
        self.connected.clear()

    # -- what a test drives --------------------------------------------------------------

    def confirm(self, partition: int) -> None:
        """The broker's consume-ok for ``partition``."""
        self.sink(Subscribed(partition))

    def end(self, partition: int) -> None:
        """The cancel is done: the worker gets END after its last delivery."""
        with self._lock:
            channel = self.channels[partition]
            generation = self.generations[partition]
            self._ended.add(partition)
        self.sink(End(partition, cast(Channel, channel), generation))

    def keep(self, partition: int) -> None:
        """A ``resume`` came before the cancel: the drain is called off (``Kept``)."""
        self.sink(Kept(partition))

    def empty(self, partition: int) -> None:
        """A drain's window is full and every delivery handled: ``Emptied``."""
        assert self.early_release, "only a quorum stream's broker reports emptied"
        self.sink(Emptied(partition))

    def publish(
        self,
        partition: int,
        body: bytes,
        *,
        headers: dict[str, Any] | None = None,
        message_id: str | None = None,
        redelivered: bool = False,
        generation: int | None = None,
    ) -> int:
        """Deliver a message on the partition's channel; its delivery tag. ``generation``:
        stamp it as of that subscription (by default the latest)."""
        with self._lock:
            channel = self.channels[partition]
            tag = next(self._tags)
            if generation is None:
                generation = self.generations[partition]
        properties = pika.BasicProperties(message_id=message_id, headers=headers)
        delivery = Delivery(
            partition, cast(Channel, channel), tag, redelivered, properties, body, generation
        )
        self.sink(delivery)
        return tag

    def widen(self, spec: StreamSpec) -> None:
        self.spec = spec

    def acked(self, partition: int) -> list[int]:
        """Delivery tags acked on the partition's channels, oldest first."""
        with self._lock:
            return list(self._acked.get(partition, []))

    def lose_channel(self, partition: int) -> None:
        """The broker closes the partition's channel (what it had unacked is requeued)."""
        with self._lock:
            channel = self.channels.pop(partition)
            channel.is_open = False
        self.sink(ChannelLost(partition))

    def refuse(self, partition: int, reason: str) -> None:
        """The broker closes the partition's channel with 403 ACCESS_REFUSED."""
        with self._lock:
            channel = self.channels.pop(partition)
            channel.is_open = False
        self.sink(Refused(partition, reason))

    def disconnect(self) -> None:
        """The connection drops: every subscribed partition's channel with it."""
        with self._lock:
            lost = sorted(self.channels)
            for channel in self.channels.values():
                channel.is_open = False
            self.channels.clear()
        self.connected.clear()
        self.sink(Connection(False))
        for partition in lost:
            self.sink(ChannelLost(partition))

    def reconnect(self) -> None:
        self.connected.set()
        self.sink(Connection(True))

    def subscribed(self) -> set[int]:
        with self._lock:
            return set(self.channels)

    def count(self, call: str, partition: int = -1) -> int:
        """How often ``call`` was made (for ``partition``)."""
        with self._lock:
            return sum(1 for c, p in self.calls if c == call and p == partition)

    def _record(self, call: str, partition: int) -> None:
        with self._lock:
            self.calls.append((call, partition))


_STUB_IS_A_FACTORY: BrokerFactory = StubBroker  # mypy checks it against the port

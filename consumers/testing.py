"""A stub of the consumer's RabbitMQ edge, for unit tests: no server, callbacks you drive.

:class:`StubBroker` takes :class:`consumers.broker.Broker`'s place
(``Consumer(..., broker=StubBroker)``): same constructor, same methods, and it
records what the daemon and the partition workers ask of it. By default it answers
as a healthy broker does, at once: ``subscribe`` is confirmed (``on_subscribed``),
``cancel`` sends the partition's worker its END mark (after whatever was delivered),
and the worker's ``finish`` reports the partition drained (``on_drained``). With
``auto=False`` a test answers itself: :meth:`confirm`, :meth:`end`, :meth:`empty`
(the drain proved nothing is left: the daemon releases, then calls ``cut``), or
:meth:`keep` (a drain called off by ``resume``). A test also
delivers messages (:meth:`publish`), closes a channel (:meth:`lose_channel`) and drops
or restores the connection (:meth:`disconnect`, :meth:`reconnect`).

tests/unit/test_consumer_daemon.py uses it; the real broker is proven against
RabbitMQ by tests/integration/test_broker_drain.py and the group tests.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import pika
from pika.channel import Channel

from consumers.broker import END, Broker, Delivery
from consumers.priority import consume_arguments
from producer.contract import StreamSpec

__all__ = ["StubBroker", "StubChannel"]


@dataclass(eq=False)
class StubChannel:
    """A partition's channel: open until the stub closes it."""

    partition: int
    is_open: bool = True


class StubBroker(Broker):
    """:class:`Broker`'s surface without RabbitMQ (the module docstring). Thread-safe."""

    def __init__(
        self,
        url: str,
        spec: StreamSpec,
        *,
        prefetch: int,
        heartbeat: int,
        name: str,
        deliver: Callable[[int, Delivery | object], None],
        on_subscribed: Callable[[int], None],
        on_drained: Callable[[int], None],
        on_channel_lost: Callable[[int], None],
        on_connection: Callable[[bool], None],
        on_refused: Callable[[int, str], None] | None = None,
        on_activated: Callable[[int], None] | None = None,
        on_standby_lost: Callable[[int], None] | None = None,
        on_emptied: Callable[[int], None] | None = None,
        on_kept: Callable[[int], None] | None = None,
        auto: bool = True,
    ) -> None:
        threading.Thread.__init__(self, name=f"{name}-stub", daemon=True)  # never started
        self.spec = spec
        self.prefetch = prefetch
        self.auto = auto
        self.deliver = deliver
        self.on_subscribed = on_subscribed
        self.on_drained = on_drained
        self.on_channel_lost = on_channel_lost
        self.on_connection = on_connection
        self.on_refused = on_refused
        self.on_emptied = on_emptied
        self.on_kept = on_kept
        self.connected = threading.Event()
        self.stopped = threading.Event()
        self.calls: list[tuple[str, int]] = []  # ("subscribe", p), ("cancel", p), ...
        self.channels: dict[int, StubChannel] = {}  # the partitions subscribed now
        self._acked: dict[int, list[int]] = {}
        self._ended: set[int] = set()  # cancels done (END sent): too late to resume
        self._lock = threading.Lock()
        self._tags = itertools.count(1)

    # -- what the daemon and the workers call --------------------------------------------

    def start(self) -> None:
        self.reconnect()

    def join(self, timeout: float | None = None) -> None:
        pass

    def stand_by(self, partition: int) -> bool:
        """The stub has no waiting consumers: standing by is recorded, never activated."""
        with self._lock:
            self.calls.append(("stand_by", partition))
        return True

    def stand_down(self, partition: int) -> None:
        with self._lock:
            self.calls.append(("stand_down", partition))

    def give_back(self, partition: int) -> None:
        with self._lock:
            self.calls.append(("give_back", partition))

    def subscribe(self, partition: int, priority: int | None = None) -> bool:
        consume_arguments(priority)  # a bad priority fails as on the real broker
        self._record("subscribe", partition)
        if not self.connected.is_set():
            return False
        with self._lock:
            self.channels[partition] = StubChannel(partition)
            self._ended.discard(partition)
        if self.auto:
            self.confirm(partition)
        return True

    def cancel(self, partition: int) -> None:
        self._record("cancel", partition)
        with self._lock:
            subscribed = partition in self.channels
        if not subscribed:
            self.on_channel_lost(partition)
        elif self.auto:
            self.end(partition)

    def resume(self, partition: int) -> None:
        """A drain called off: kept at once while subscribed (a test that ended the cancel
        with :meth:`end` first gets nothing, as from a broker that sent it)."""
        self._record("resume", partition)
        with self._lock:
            kept = partition in self.channels and partition not in self._ended
        if kept and self.auto and self.on_kept is not None:
            self.on_kept(partition)

    def warm(self, partition: int) -> None:
        self._record("warm", partition)

    def ready(self, partitions: list[int], reply: Callable[[dict[int, int]], None]) -> None:
        """Every queue empty (the stub keeps no queues)."""
        reply(dict.fromkeys(partitions, 0))

    def cut(self, partition: int) -> None:
        """After :meth:`empty`: the cancel, the held acks, then drained (at once)."""
        self._record("cut", partition)
        with self._lock:
            channel = self.channels.pop(partition, None)
        if channel is None:
            self.on_channel_lost(partition)
        else:
            self.on_drained(partition)

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
        if done:
            self.on_drained(partition)
        else:
            self.on_channel_lost(partition)

    def fence(self) -> None:
        self._record("fence", -1)
        with self._lock:
            for channel in self.channels.values():
                channel.is_open = False
            self.channels.clear()

    def stop(self) -> None:
        self._record("stop", -1)
        self.stopped.set()
        self.connected.clear()

    # -- what a test drives --------------------------------------------------------------

    def confirm(self, partition: int) -> None:
        """The broker's consume-ok for ``partition``."""
        self.on_subscribed(partition)

    def end(self, partition: int) -> None:
        """The cancel is done: the worker gets END after its last delivery."""
        with self._lock:
            channel = self.channels[partition]
            self._ended.add(partition)
        self.deliver(partition, (END, channel))

    def keep(self, partition: int) -> None:
        """A ``resume`` came before the cancel: the drain is called off (``on_kept``)."""
        assert self.on_kept is not None
        self.on_kept(partition)

    def empty(self, partition: int) -> None:
        """A drain's window is full and every delivery handled: ``on_emptied``."""
        assert self.on_emptied is not None
        self.on_emptied(partition)

    def publish(
        self,
        partition: int,
        body: bytes,
        *,
        headers: dict[str, Any] | None = None,
        message_id: str | None = None,
        redelivered: bool = False,
    ) -> int:
        """Deliver a message to the partition's worker; its delivery tag."""
        with self._lock:
            channel = self.channels[partition]
            tag = next(self._tags)
        properties = pika.BasicProperties(message_id=message_id, headers=headers)
        delivery = Delivery(partition, cast(Channel, channel), tag, redelivered, properties, body)
        self.deliver(partition, delivery)
        return tag

    def acked(self, partition: int) -> list[int]:
        """Delivery tags acked on the partition's channels, oldest first."""
        with self._lock:
            return list(self._acked.get(partition, []))

    def lose_channel(self, partition: int) -> None:
        """The broker closes the partition's channel (what it had unacked is requeued)."""
        with self._lock:
            channel = self.channels.pop(partition)
            channel.is_open = False
        self.on_channel_lost(partition)

    def refuse(self, partition: int, reason: str) -> None:
        """The broker closes the partition's channel with 403 ACCESS_REFUSED."""
        with self._lock:
            channel = self.channels.pop(partition)
            channel.is_open = False
        if self.on_refused is not None:
            self.on_refused(partition, reason)

    def disconnect(self) -> None:
        """The connection drops: every subscribed partition's channel with it."""
        with self._lock:
            lost = sorted(self.channels)
            for channel in self.channels.values():
                channel.is_open = False
            self.channels.clear()
        self.connected.clear()
        self.on_connection(False)
        for partition in lost:
            self.on_channel_lost(partition)

    def reconnect(self) -> None:
        self.connected.set()
        self.on_connection(True)

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

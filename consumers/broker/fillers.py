"""Fillers: a drain fills its own prefetch window, so that it never cancels with credit left.

A drain may cancel its consumer only once the broker provably has no credit left for it
(``partq.consumers.state.window``): then nothing can be in flight, and the cancel returns nothing. A
busy partition's window fills by itself; an idle or trickling one used to be cancelled
with credit left once it looked quiet, and a delivery in flight at that cancel came back
behind newer messages the next owner was already given (RabbitMQ 3.10 quorum queues under
load or after a node restart).
Instead, a drain whose window is not full publishes, as it begins, as many *fillers* as it
has credit left into its own queue: empty messages through the stream's dead-letter
exchange, to which every partition queue is bound under its own name
(``partq.producer.topology``). They reach the queue behind whatever is ready, the broker
delivers them to the owner (still the active consumer, its acks held), the window fills,
and the cancel is exact. Fillers the owner did not need (the window filled with messages
that were ready, or published meanwhile) go to the next owner.

Every consumer acks a filler without handling it: a delivery that came through the
dead-letter exchange (:attr:`Fillers.exchange`) is one, whatever its headers say, so a
consumer's right to write to that exchange (its dead letters and parking queues) lets it
add no message that is handled. ``partq.consumers.broker.channels`` acks it as it arrives on a
subscription's channel, and one a hot standby was sent once the standby is promoted or
adopted (given back, it is returned with the rest): no worker ever sees one.

A queue not bound so (a stream declared by partq 0.2.0 or older, or a queue a shrinking
resize retired: its cut unbinds it, so that nothing refills it before its delete) returns
the fillers (``mandatory``), and a stream with no dead-letter exchange closes the fillers'
channel: either way the drain is told (``on_unfilled``) and cancels as it did before,
and no later drain of that queue (of any, without the exchange) on this connection fills.
Fillers go on a channel of their own, never on a consuming one, so that such an error
never closes a partition's channel.

Threads. Everything runs on the broker's pika I/O thread, like ``partq.consumers.broker.channels``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pika
from partq.producer.contract import (
    CONTROL_FILL,
    HEADER_CONTROL,
    StreamSpec,
    queue_name,
)

__all__ = ["Fillers"]

log = logging.getLogger("partq.consumer.broker")

_PROPERTIES = pika.BasicProperties(
    delivery_mode=1, app_id="partq", headers={HEADER_CONTROL: CONTROL_FILL}
)


class Fillers:
    """The fillers' channel on one connection, and the drains whose fillers are out."""

    def __init__(self, spec: StreamSpec, on_unfilled: Callable[[int, int], None]) -> None:
        # the stream's name only: a resize widens the consumer's spec, and a grown
        # partition's queue is beyond the spec this began with
        self.stream = spec.scope
        self.exchange = spec.dead_letter_exchange  # a delivery published to it is one
        self.on_unfilled = on_unfilled  # (partition, drain): its fillers cannot reach it
        self.usable = True  # False once this stream turned out to have no such exchange
        self._unbound: set[int] = set()  # partitions whose queue returned its fillers
        self._channel: Any = None  # once open
        self._opening: object | None = None  # a token while it opens (reset: a new one)
        self._waiting: list[tuple[int, int]] = []  # (partition, count) until it is open
        self._out: dict[int, int] = {}  # partition -> the drain whose fillers were sent
        self._queues: dict[str, int] = {}  # queue name -> partition, for returns
        self.filled = 0  # drains that published fillers (on every connection)
        self.sent = 0  # fillers published

    def reset(self) -> None:
        """The connection went: nothing of it is ours any more."""
        self._channel = self._opening = None
        self._waiting.clear()
        self._out.clear()

    def usable_for(self, partition: int) -> bool:
        """Whether a drain of ``partition`` may fill its window."""
        return self.usable and partition not in self._unbound

    def publish(self, connection: Any, partition: int, drain: int, count: int) -> None:
        """Send ``count`` fillers into ``partition``'s queue for its drain ``drain``."""
        if not self.usable_for(partition):
            self.on_unfilled(partition, drain)
            return
        self._out[partition] = drain
        if self._channel is not None and self._channel.is_open:
            self._send(partition, count)
            return
        self._waiting.append((partition, count))
        if self._opening is None:
            token = self._opening = object()
            connection.channel(on_open_callback=lambda channel: self._opened(channel, token))

    def _opened(self, channel: Any, token: object) -> None:
        if token is not self._opening:
            channel.close()  # the connection was reset meanwhile
            return
        self._channel, self._opening = channel, None
        channel.add_on_return_callback(self._returned)
        channel.add_on_close_callback(self._closed)
        waiting, self._waiting = self._waiting, []
        for partition, count in waiting:
            self._send(partition, count)

    def _send(self, partition: int, count: int) -> None:
        queue = queue_name(self.stream, partition)
        self._queues[queue] = partition
        self.filled += 1
        self.sent += count
        log.debug("partition %d: draining, %d fillers into %s", partition, count, queue)
        for _ in range(count):
            self._channel.basic_publish(self.exchange, queue, b"", _PROPERTIES, mandatory=True)

    def _returned(self, _channel: Any, method: Any, _properties: Any, _body: bytes) -> None:
        partition = self._queues.get(method.routing_key)
        if partition is None or partition in self._unbound:
            return  # one return tells: the rest of its fillers come back too
        self._unbound.add(partition)
        log.warning(
            "queue %s is not bound to the dead-letter exchange %s (a stream declared by partq "
            "0.2.0 or older, or a queue a resize retired): its drains cancel with credit left, "
            "as before, and a delivery in flight then may come back out of order; run `partq "
            "stream create %s` again to add the bindings",
            method.routing_key,
            self.exchange,
            self.stream,
        )
        self._unfilled(partition)

    def _closed(self, channel: Any, reason: BaseException) -> None:
        if channel is not self._channel:
            return
        self._channel = None
        if getattr(reason, "reply_code", None) in (403, 404):  # no such exchange, or no right
            self.usable = False
            log.warning(
                "fillers for stream %s cannot be published (%s): a drain of an idle "
                "partition cancels with credit left, as before; run `partq stream create %s` "
                "again, and give the consumer write access to that exchange (`partq security "
                "roles`)",
                self.stream,
                reason,
                self.stream,
            )
        self._waiting.clear()
        for partition in list(self._out):
            self._unfilled(partition)

    def _unfilled(self, partition: int) -> None:
        drain = self._out.pop(partition, None)
        if drain is not None:
            self.on_unfilled(partition, drain)

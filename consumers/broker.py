"""The consumer's RabbitMQ edge: one connection, one channel per partition, one I/O thread.

Only the I/O thread touches pika objects; other threads call the public
methods, which hop onto the I/O loop with ``add_callback_threadsafe``.
Callbacks into the daemon are queued events, never direct calls.

Drain: ``cancel(p)`` sends basic.cancel; deliveries that arrive before
CancelOk still go to the partition's worker; on CancelOk a sentinel follows
them; the worker handles and acks everything, then asks to close the channel,
and ``on_drained(p)`` fires once the broker confirmed the close — after every
ack. Nothing is ever rejected or requeued by a planned handoff.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import SelectConnection
from pika.channel import Channel

from producer.amqp import connection_parameters
from producer.contract import StreamSpec

__all__ = ["END", "Broker", "Delivery"]

log = logging.getLogger("partq.consumer.broker")


@dataclass(frozen=True, slots=True)
class Delivery:
    partition: int
    channel: Channel
    delivery_tag: int
    redelivered: bool
    properties: pika.BasicProperties
    body: bytes


END = object()  # follows the last delivery of a cancelled subscription


class Broker(threading.Thread):
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
    ) -> None:
        super().__init__(name=f"{name}-amqp", daemon=True)
        self.spec = spec
        self.params = connection_parameters(url, name=name, heartbeat=heartbeat)
        self.params.connection_attempts = 1
        self.prefetch = prefetch
        self._deliver = deliver
        self._on_subscribed = on_subscribed
        self._on_drained = on_drained
        self._on_channel_lost = on_channel_lost
        self._on_connection = on_connection
        self._connection: SelectConnection | None = None
        self._channels: dict[int, Channel] = {}
        self._closing_channels: set[int] = set()
        self._stopping = False
        self.connected = threading.Event()

    # -- thread-safe API -----------------------------------------------------------------

    def _call(self, fn: Callable[[], None]) -> bool:
        connection = self._connection
        if connection is None or not connection.is_open:
            return False
        try:
            connection.ioloop.add_callback_threadsafe(fn)
        except Exception:
            return False
        return True

    def subscribe(self, partition: int) -> None:
        if not self._call(lambda: self._open(partition)):
            self._on_channel_lost(partition)

    def cancel(self, partition: int) -> None:
        if not self._call(lambda: self._cancel(partition)):
            self._on_channel_lost(partition)

    def ack(self, channel: Channel, delivery_tag: int) -> None:
        def do() -> None:
            if channel.is_open:
                channel.basic_ack(delivery_tag)

        self._call(do)

    def close_channel(self, partition: int, channel: Channel) -> None:
        def do() -> None:
            if channel.is_open:
                self._closing_channels.add(partition)
                channel.close()
            elif self._channels.get(partition) is channel:
                del self._channels[partition]
                self._on_drained(partition)

        if not self._call(do):
            self._on_channel_lost(partition)

    def close_all(self) -> None:
        """Fence: drop every channel now; the broker requeues what was not acked.

        Silent: the caller starts its partitions over, so a late ``on_channel_lost`` for
        one of these channels would be taken for the loss of its new subscription.
        """

        def do() -> None:
            for partition, channel in sorted(self._channels.items()):
                del self._channels[partition]  # _channel_closed then ignores this channel
                self._closing_channels.discard(partition)
                if channel.is_open:
                    channel.close()

        self._call(do)

    def stop(self) -> None:
        self._stopping = True

        def do() -> None:
            if self._connection is not None and self._connection.is_open:
                self._connection.close()

        if not self._call(do) and self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.ioloop.add_callback_threadsafe(self._connection.ioloop.stop)

    # -- the I/O thread ------------------------------------------------------------------

    def run(self) -> None:
        backoff = 0.2
        while not self._stopping:
            connection = SelectConnection(
                self.params,
                on_open_callback=self._opened,
                on_open_error_callback=self._open_failed,
                on_close_callback=self._closed,
            )
            self._connection = connection
            connection.ioloop.start()
            self._connection = None
            if self.connected.is_set():
                backoff = 0.2
            self.connected.clear()
            self._on_connection(False)
            lost = sorted(self._channels)
            self._channels.clear()
            self._closing_channels.clear()
            for partition in lost:
                self._on_channel_lost(partition)
            if self._stopping:
                return
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _open_failed(self, connection: SelectConnection, error: BaseException) -> None:
        log.warning("cannot connect to RabbitMQ: %s", error)
        connection.ioloop.stop()

    def _opened(self, connection: SelectConnection) -> None:
        self.connected.set()
        self._on_connection(True)

    def _closed(self, connection: SelectConnection, reason: BaseException) -> None:
        if not self._stopping:
            log.warning("lost the RabbitMQ connection: %s", reason)
        connection.ioloop.stop()

    def _open(self, partition: int) -> None:
        assert self._connection is not None
        old = self._channels.get(partition)
        if old is not None and old.is_open:
            return
        self._connection.channel(on_open_callback=lambda ch: self._consume(partition, ch))

    def _consume(self, partition: int, channel: Channel) -> None:
        self._channels[partition] = channel
        channel.add_on_close_callback(
            lambda ch, reason: self._channel_closed(partition, ch, reason)
        )

        def on_message(ch: Channel, method: Any, properties: Any, body: bytes) -> None:
            self._deliver(
                partition,
                Delivery(partition, ch, method.delivery_tag, method.redelivered, properties, body),
            )

        def on_qos(_frame: Any) -> None:
            channel.basic_consume(
                self.spec.queue(partition),
                on_message,
                callback=lambda _f: self._on_subscribed(partition),
            )

        channel.basic_qos(prefetch_count=self.prefetch, callback=on_qos)

    def _cancel(self, partition: int) -> None:
        channel = self._channels.get(partition)
        if channel is None or not channel.is_open:
            self._on_channel_lost(partition)
            return
        tags = list(channel.consumer_tags)
        if not tags:
            self._deliver(partition, (END, channel))
            return
        channel.basic_cancel(tags[0], callback=lambda _f: self._deliver(partition, (END, channel)))
        # pika rejects (requeues) every delivery that arrives between basic.cancel and
        # CancelOk while the tag is in ``_cancelled``; a requeue goes to the back of a quorum
        # queue and breaks per-key order. Keep the consumer callback until CancelOk (pika's
        # own CancelOk handler removes it), so those deliveries are handled and acked too.
        channel._cancelled.discard(tags[0])

    def _channel_closed(self, partition: int, channel: Channel, reason: BaseException) -> None:
        if self._channels.get(partition) is not channel:
            return
        if partition in self._closing_channels:
            del self._channels[partition]
            self._closing_channels.discard(partition)
            self._on_drained(partition)
        elif self._connection is not None and self._connection.is_open:
            del self._channels[partition]
            log.warning("partition %d: channel closed: %s", partition, reason)
            self._on_channel_lost(partition)
        # else the connection is going down: run() reports every channel it had

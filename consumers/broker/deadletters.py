"""The stream's dead-letter queue, as a worker writes to it: one confirmed publish per message.

Threads. One :class:`DeadLetters` is shared by the member's workers, their watchdogs and
the keyed workers' pool threads; its lock serialises the publishes (each on a short-lived
connection of its own), so nothing of it crosses to the pika I/O thread.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback

import pika
import pika.exceptions
from partq.consumers.broker.port import Delivery
from partq.producer.contract import (
    HEADER_ATTEMPTS,
    HEADER_ERROR,
    HEADER_ERROR_TYPE,
    HEADER_FAILED_MS,
    HEADER_FAILED_PARTITION,
    HEADER_MEMBER,
    StreamSpec,
)

from partq.kernel.amqp import AmqpURL, blocking_connection

__all__ = ["DeadLetters"]

log = logging.getLogger("partq.consumer.worker")


class DeadLetters:
    """Publishes a message to the stream's dead-letter queue, with the reason in headers."""

    def __init__(self, url: AmqpURL, spec: StreamSpec, member: str) -> None:
        self.url = url
        self.spec = spec
        self.member = member
        self._lock = threading.Lock()
        self._warned = False

    def publish(self, delivery: Delivery, error: BaseException, attempts: int) -> None:
        """Publish with a confirm; raises on failure (the caller then does not ack).

        ``attempts``: the handler attempts made (0: it never ran, malformed headers).
        """
        props = delivery.properties
        headers = dict(props.headers or {})
        headers.update(
            {
                HEADER_ERROR: "".join(traceback.format_exception_only(error)).strip()[:2000],
                HEADER_ERROR_TYPE: type(error).__name__,
                HEADER_ATTEMPTS: attempts,
                HEADER_FAILED_PARTITION: delivery.partition,
                HEADER_MEMBER: self.member,
                HEADER_FAILED_MS: int(time.time() * 1000),
            }
        )
        properties = pika.BasicProperties(
            delivery_mode=2,
            message_id=props.message_id,
            timestamp=props.timestamp,
            headers=headers,
            app_id="partq",
            content_type=props.content_type,
        )
        spec = self.spec
        with self._lock, blocking_connection(self.url, name=f"partq-dlq-{self.member}") as conn:
            channel = conn.channel()
            channel.confirm_delivery()
            try:
                channel.basic_publish(
                    spec.dead_letter_exchange,
                    spec.dead_letter_queue,
                    delivery.body,
                    properties,
                    mandatory=True,
                )
                return
            except pika.exceptions.ChannelClosedByBroker as e:
                if e.reply_code != 404:  # NOT_FOUND: a stream made before the exchange was
                    raise
            if not self._warned:
                self._warned = True
                log.warning(
                    "stream %s has no dead-letter exchange %s (created by an older partq): "
                    "dead letters go through the default exchange; run `partq stream create "
                    "%s` again to add it",
                    spec.name,
                    spec.dead_letter_exchange,
                    spec.name,
                )
            channel = conn.channel()
            channel.confirm_delivery()
            channel.basic_publish(
                "", spec.dead_letter_queue, delivery.body, properties, mandatory=True
            )

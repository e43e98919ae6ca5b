"""A partition's worker thread: handles its deliveries in order, retries, dead-letters, acks."""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions

from consumers import metrics
from consumers.broker import END, Broker, Delivery
from consumers.message import Handler, message_from
from coordinator.session import Session
from producer import logs
from producer.amqp import blocking_connection
from producer.contract import StreamSpec

__all__ = ["DeadLetters", "Worker"]

log = logging.getLogger("partq.consumer.worker")
STOP = object()


class DeadLetters:
    """Publishes a message that exhausted its retries to the stream's dead-letter queue."""

    def __init__(self, url: str, spec: StreamSpec, member: str) -> None:
        self.url = url
        self.spec = spec
        self.member = member
        self._lock = threading.Lock()

    def publish(self, delivery: Delivery, error: BaseException, attempts: int) -> None:
        """Publish with a confirm; raises on failure (the caller then does not ack)."""
        props = delivery.properties
        headers = dict(props.headers or {})
        headers.update({
            "x-partq-error": "".join(traceback.format_exception_only(error)).strip()[:2000],
            "x-partq-error-type": type(error).__name__,
            "x-partq-attempts": attempts,
            "x-partq-partition": delivery.partition,
            "x-partq-member": self.member,
            "x-partq-failed-ms": int(time.time() * 1000),
        })  # fmt: skip
        properties = pika.BasicProperties(
            delivery_mode=2, message_id=props.message_id, timestamp=props.timestamp,
            headers=headers, app_id="partq", content_type=props.content_type,
        )  # fmt: skip
        with self._lock, blocking_connection(self.url, name=f"partq-dlq-{self.member}") as conn:
            channel = conn.channel()
            channel.confirm_delivery()
            channel.basic_publish(
                "", self.spec.dead_letter_queue, delivery.body, properties, mandatory=True
            )


class Worker(threading.Thread):
    def __init__(
        self,
        *,
        spec: StreamSpec,
        partition: int,
        member: str,
        handler: Handler,
        broker: Broker,
        session: Session,
        dead_letters: DeadLetters,
        max_attempts: int,
        retry_backoff: float,
        previous: Worker | None,
        freed_at: float | None,
        on_first_delivery: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(name=f"partition-{partition}", daemon=True)
        self.spec = spec
        self.partition = partition
        self.member = member
        self.handler = handler
        self.broker = broker
        self.session = session
        self.dead_letters = dead_letters
        self.max_attempts = max_attempts
        self.retry_backoff = retry_backoff
        self.previous = previous
        self.freed_at = freed_at
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.stopped = threading.Event()
        self._labels = (spec.name, member)

    def stop(self) -> None:
        """Stop without handling what is queued (the broker requeues it)."""
        self.stopped.set()
        self.inbox.put(STOP)

    def run(self) -> None:
        with logs.bind(stream=self.spec.name, member=self.member, partition=self.partition):
            self._run()

    def _run(self) -> None:
        if self.previous is not None:
            self.previous.join()  # never two handlers of one partition in this process
        first = True
        while True:
            item = self.inbox.get()
            if item is STOP:
                return
            if isinstance(item, tuple) and item[0] is END:
                self.broker.finish(self.partition, item[1])
                return
            delivery: Delivery = item
            if self.stopped.is_set() or not delivery.channel.is_open:
                continue
            if not self.session.fresh() and not self.session.wait_fresh(self.session.ttl):
                continue  # fenced: our lease is gone, the broker redelivers to the new owner
            if first and self.freed_at is not None:
                metrics.HANDOFF_GAP_SECONDS.labels(*self._labels).observe(
                    max(0.0, time.time() - self.freed_at)
                )
            first = False
            if self._handle(delivery):
                self.broker.ack(self.partition, delivery.channel, delivery.delivery_tag)

    def _handle(self, delivery: Delivery) -> bool:
        """Run the handler with bounded retries; True when the delivery may be acked."""
        props = delivery.properties
        if delivery.redelivered:
            metrics.REDELIVERIES.labels(*self._labels).inc()
        attempt = 1
        while True:
            message = message_from(
                self.spec.name, self.partition, delivery.body, props.message_id,
                props.headers, delivery.redelivered, attempt,
            )  # fmt: skip
            started = time.monotonic()
            try:
                self.handler(message)
            except Exception as error:
                metrics.HANDLER_SECONDS.labels(*self._labels).observe(time.monotonic() - started)
                if attempt >= self.max_attempts:
                    return self._dead_letter(delivery, error, attempt)
                metrics.HANDLED.labels(*self._labels, "retry").inc()
                log.warning(
                    "partition %d: handler failed (attempt %d/%d): %r",
                    self.partition, attempt, self.max_attempts, error,
                )  # fmt: skip
                if self.stopped.wait(min(self.retry_backoff * 2 ** (attempt - 1), 5.0)):
                    return False
                attempt += 1
                continue
            metrics.HANDLER_SECONDS.labels(*self._labels).observe(time.monotonic() - started)
            metrics.HANDLED.labels(*self._labels, "ok").inc()
            return True

    def _dead_letter(self, delivery: Delivery, error: BaseException, attempts: int) -> bool:
        backoff = 0.2
        while not self.stopped.is_set():
            try:
                self.dead_letters.publish(delivery, error, attempts)
            except Exception as e:  # broker trouble: keep the message, try again
                log.warning("partition %d: dead-lettering failed: %s", self.partition, e)
                self.stopped.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            metrics.HANDLED.labels(*self._labels, "dead_lettered").inc()
            metrics.DEAD_LETTERED.labels(*self._labels).inc()
            log.error(
                "partition %d: message %s dead-lettered after %d attempts: %r",
                self.partition, delivery.properties.message_id, attempts, error,
            )  # fmt: skip
            return True
        return False

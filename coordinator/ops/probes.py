"""What a daemon's HTTP endpoints ask the broker and etcd: cached, rate-limited, one connection.

A scrape of ``/metrics`` or a load of the status page must not cost an AMQP connection
(200 GETs once opened about 190): :class:`QueueDepths` keeps one ``BlockingConnection``
per daemon, used under a lock, reopened after a failure, and refreshes a stream's queue
statistics at most once per ``max_age`` seconds; requests in between get the cached
result, and a failure is cached as long, so an unreachable broker is not asked on every
request either. :class:`EtcdHealth` does the same for ``/readyz``'s etcd check.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable

import pika
import pika.exceptions
from partq.coordinator import metrics
from partq.producer.contract import StreamSpec
from partq.producer.queue_probes import QueueStats, queue_stats
from partq.producer.registry import Registry

from partq.kernel.amqp import AmqpURL, connect_blocking, unavailable
from partq.kernel.errors import BrokerUnavailable, PartqError
from partq.kernel.etcd import etcd_errors

__all__ = ["DEFAULT_MAX_AGE", "DepthExporter", "EtcdHealth", "QueueDepths"]

log = logging.getLogger("partq.probes")
DEFAULT_MAX_AGE = 2.0


class _Warner:
    """Logs a failure at warning once (not per request), and the recovery at info."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failing: str | None = None

    def failed(self, reason: str) -> None:
        if self.failing is None:
            log.warning("%s: %s", self.what, reason)
        self.failing = reason

    def ok(self) -> None:
        if self.failing is not None:
            log.info("%s: working again", self.what)
        self.failing = None


class QueueDepths:
    """Queue statistics of streams over one AMQP connection, refreshed at most every
    ``max_age`` seconds per stream. Thread-safe."""

    def __init__(
        self,
        amqp_url: AmqpURL,
        *,
        name: str = "partq-depth",
        max_age: float = DEFAULT_MAX_AGE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.amqp_url = amqp_url
        self.name = name
        self.max_age = max_age
        self._clock = clock
        self._lock = threading.Lock()
        self._connection: pika.BlockingConnection | None = None
        self._cache: dict[str, tuple[float, StreamSpec, list[QueueStats] | str]] = {}
        self._counts: dict[str, tuple[float, int | None]] = {}
        self._warner = _Warner("queue depths unavailable")
        self.connections_opened = 0

    def stats(self, spec: StreamSpec) -> list[QueueStats]:
        """``spec``'s partition queues, then any beyond its count (``partition >= P``).

        Raises :class:`BrokerUnavailable` (with the cached reason) while RabbitMQ fails.
        """
        with self._lock:
            now = self._clock()
            cached = self._cache.get(spec.scope)
            if cached is None or cached[1] != spec or now - cached[0] >= self.max_age:
                cached = (now, spec, self._refresh(spec))
                self._cache[spec.scope] = cached
            result = cached[2]
        if isinstance(result, str):
            raise BrokerUnavailable(result)
        return result

    def messages(self, queue: str) -> int | None:
        """Ready messages in one more queue (a dead-letter or parking queue), cached as
        long; None if it does not exist or the broker cannot be asked."""
        with self._lock:
            now = self._clock()
            cached = self._counts.get(queue)
            if cached is not None and now - cached[0] < self.max_age:
                return cached[1]
            count: int | None = None
            try:
                channel = self._connect().channel()
                try:
                    count = int(channel.queue_declare(queue, passive=True).method.message_count)
                    channel.close()
                except pika.exceptions.ChannelClosedByBroker:
                    count = None  # NOT_FOUND: no such queue (the channel is closed)
            except (BrokerUnavailable, pika.exceptions.AMQPError, OSError):
                self._drop()
            if len(self._counts) > 10_000:
                self._counts.clear()
            self._counts[queue] = (now, count)
            return count

    def _refresh(self, spec: StreamSpec) -> list[QueueStats] | str:
        """Under the lock: the stats, or the reason they cannot be had."""
        for attempt in (1, 2):
            reused = self._connection is not None
            try:
                connection = self._connect()
                result = queue_stats(connection, spec, beyond=True)
            except BrokerUnavailable as e:
                self._warner.failed(str(e))
                return str(e)
            except (pika.exceptions.AMQPError, OSError) as e:
                self._drop()
                if reused and attempt == 1:
                    continue  # the kept connection died (idle, broker restart): one fresh try
                reason = str(unavailable(self.amqp_url, e))
                self._warner.failed(reason)
                return reason
            self._warner.ok()
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _connect(self) -> pika.BlockingConnection:
        connection = self._connection
        if connection is not None and connection.is_open:
            connection.process_data_events(0)  # answer heartbeats; raises if it is gone
            return connection
        self._drop()
        connection = connect_blocking(self.amqp_url, name=self.name)
        self.connections_opened += 1
        self._connection = connection
        return connection

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and connection.is_open:
            with contextlib.suppress(Exception):
                connection.close()

    def close(self) -> None:
        with self._lock:
            self._drop()


class EtcdHealth:
    """Whether etcd answers, asked at most every ``max_age`` seconds (for ``/readyz``)."""

    def __init__(
        self,
        registry: Registry,
        *,
        max_age: float = DEFAULT_MAX_AGE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.max_age = max_age
        self._clock = clock
        self._lock = threading.Lock()
        self._checked: tuple[float, str | None] | None = None
        self._warner = _Warner("etcd unavailable")

    def check(self) -> None:
        """Raise :class:`PartqError` naming why etcd does not answer; return if it does."""
        with self._lock:
            now = self._clock()
            if self._checked is None or now - self._checked[0] >= self.max_age:
                self._checked = (now, self._ask())
            reason = self._checked[1]
        if reason is not None:
            raise PartqError(reason)

    def _ask(self) -> str | None:
        try:
            with etcd_errors(self.registry.where):
                self.registry.client.status()
        except PartqError as e:
            self._warner.failed(str(e))
            return str(e)
        self._warner.ok()
        return None


class DepthExporter:
    """Sets ``partq_queue_messages`` for the streams this process leads (per scrape, from
    :class:`QueueDepths`' cache); removes the series of streams it no longer leads, or whose
    depths cannot be had now, rather than leaving stale values."""

    def __init__(self, depths: QueueDepths) -> None:
        self.depths = depths
        self._lock = threading.Lock()
        self._exported: dict[str, set[tuple[str, str]]] = {}

    def export(self, leading: Iterable[StreamSpec]) -> None:
        with self._lock:
            current: dict[str, set[tuple[str, str]]] = {}
            for spec in leading:
                try:
                    stats = self.depths.stats(spec)
                except BrokerUnavailable:
                    continue  # logged once by QueueDepths; no series until it is back
                labels = current.setdefault(spec.scope, set())
                for q in stats:
                    if q.messages is not None:
                        partition = str(q.partition)
                        metrics.QUEUE_MESSAGES.labels(spec.scope, partition, q.queue).set(
                            q.messages
                        )
                        labels.add((partition, q.queue))
            for stream, previous in self._exported.items():
                for partition, queue in previous - current.get(stream, set()):
                    with contextlib.suppress(KeyError):
                        metrics.QUEUE_MESSAGES.remove(stream, partition, queue)
            self._exported = current

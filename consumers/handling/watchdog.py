"""How a worker stops for good: it crashed, or its watchdog gave up on a handler call.

A worker that fails (any unexpected error outside the handler: ``_crashed``) or times out
logs why, counts it (``partq_consumer_worker_failures_total{reason}``: :data:`CRASH`,
:data:`HANDLER_TIMEOUT`) and tells the daemon (``on_failure``, a queued event: ``_fail``).

With a handler timeout, one watchdog thread per member (:class:`Watchdogs`, ``watchdog``)
looks at every worker's calls under way and notices, within a quarter of the timeout or
1 s, a handler call running past it; the member's threads do not grow with its partitions. A thread
cannot be stopped, and the partition's next message must not start while this one runs,
so the message is dead-lettered (``x-partq-error-type: HandlerTimeout``) and acked (a
poison message cannot crash-loop the group); a parked message being replayed stays parked
instead. The worker never handles another message (if the handler returns, its result is
dropped: ``TimedOut``) and reports ``handler_timeout``: the daemon leaves the group and
exits non-zero.

:class:`Watchdog` is a base class of :class:`partq.consumers.handling.worker.Worker`.
Threads: ``_crashed`` runs on the worker's thread, ``_fail`` on it or the watchdog's;
``_check`` and ``_expire`` run on the watchdog's thread; they read the calls
under way (``_running``) and set ``_timed_out`` under the worker's ``_lock``, which the
handling threads take around each call; the ack and the dead letter go through the
broker's and ``DeadLetters``' thread-safe methods. :class:`Watchdogs` keeps its workers
under its own lock: workers add and remove themselves from their threads, the watchdog
thread reads a copy. While it expires one call (dead-lettering for up to
:data:`DEAD_LETTER_PATIENCE`), it checks no other: the member is then leaving anyway.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from partq.consumers import metrics
from partq.consumers.broker.port import BrokerPort, Delivery
from partq.consumers.handling.keyparking import Outcome
from partq.consumers.handling.message import Message
from partq.producer.contract import StreamSpec

from partq.kernel import logs
from partq.kernel.errors import PartqError

__all__ = [
    "CRASH",
    "DEAD_LETTER_PATIENCE",
    "HANDLER_TIMEOUT",
    "HandlerTimeout",
    "Running",
    "TimedOut",
    "Watchdog",
    "Watchdogs",
]

log = logging.getLogger("partq.consumer.worker")
# why a worker stopped for good (the label of partq_consumer_worker_failures_total)
CRASH = "crash"
HANDLER_TIMEOUT = "handler_timeout"
DEAD_LETTER_PATIENCE = 30.0  # seconds a timed-out message's dead-lettering is retried


class HandlerTimeout(PartqError):
    """The handler did not return within the handler timeout (the dead letter's error type)."""


class TimedOut(Exception):
    """The watchdog gave up on the handler call (raised to the handling thread after it)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Running:
    """The handler call under way, as the watchdog sees it."""

    delivery: Delivery
    message: Message
    started: float
    replay: bool = False  # a parked message replayed by a redrive, not the partition's


class Watchdog:
    """A worker's watchdog (the module docstring); the worker provides the attributes and
    the steps declared here."""

    spec: StreamSpec
    member: str
    partition: int
    broker: BrokerPort
    handler_timeout: float | None
    _labels: tuple[str, str]
    _lock: threading.Lock
    _running: dict[int, Running]
    _timed_out: bool
    _finished: threading.Event
    on_failure: Callable[[int, str], None] | None
    failure: str | None

    def _dead_letter(
        self, delivery: Delivery, error: BaseException, attempts: int, patience: float | None = None
    ) -> Outcome:
        raise NotImplementedError

    def _crashed(self, error: BaseException) -> None:
        """Never die silently: log, count, tell the daemon."""
        log.error(
            "partition %d: the worker failed; this member leaves the group and exits",
            self.partition,
            exc_info=error,
        )
        self._fail(CRASH)

    def _fail(self, reason: str) -> None:
        self.failure = reason
        metrics.WORKER_FAILURES.labels(*self._labels, reason).inc()
        if self.on_failure is not None:
            try:
                self.on_failure(self.partition, reason)
            except Exception:
                log.exception("partition %d: reporting the worker failure failed", self.partition)

    def _check(self) -> None:
        """On the watchdog's thread: give up on a handler call that runs past the timeout."""
        timeout = self.handler_timeout
        if timeout is None or self._finished.is_set():
            return
        with self._lock:
            if self._timed_out:
                return
            running = min(self._running.values(), key=lambda r: r.started, default=None)
            if running is None or time.monotonic() - running.started < timeout:
                return
            self._timed_out = True  # the worker never acks or handles anything again
        with logs.bind(stream=self.spec.scope, member=self.member, partition=self.partition):
            try:
                self._expire(running, timeout)
            except BaseException:
                log.exception("partition %d: giving up on the handler failed", self.partition)
            finally:
                self._fail(HANDLER_TIMEOUT)

    def _expire(self, running: Running, timeout: float) -> None:
        """On the watchdog's thread: dead-letter and ack the message; a parked one being
        replayed stays parked instead (dead-lettered, it would be in both places)."""
        delivery, message = running.delivery, running.message
        metrics.HANDLER_SECONDS.labels(*self._labels).observe(time.monotonic() - running.started)
        if running.replay:
            log.error(
                "partition %d: the handler timed out after %gs on parked message %s during a "
                "redrive: it stays parked, at the head of its key; a running handler cannot "
                "be stopped, so this member leaves the group and exits for a restart",
                self.partition,
                timeout,
                message.message_id,
            )
            return
        log.error(
            "partition %d: the handler timed out after %gs on message %s (attempt %d): "
            "dead-lettering it; a running handler cannot be stopped, so this member leaves "
            "the group and exits for a restart",
            self.partition,
            timeout,
            message.message_id,
            message.attempt,
        )
        error = HandlerTimeout(
            f"the handler did not return within {timeout:g}s (partition {self.partition}, "
            f"message {message.message_id}, attempt {message.attempt})"
        )
        if self._dead_letter(delivery, error, message.attempt, DEAD_LETTER_PATIENCE) is (
            Outcome.ACK
        ):
            self.broker.ack(self.partition, delivery.channel, delivery.delivery_tag)
        else:
            log.error(
                "partition %d: message %s could not be dead-lettered; it returns to the queue",
                self.partition,
                message.message_id,
            )


class Watchdogs:
    """One watchdog thread for a member's workers (the module docstring): started by the
    first worker it watches, ended once it watches none."""

    def __init__(self, timeout: float) -> None:
        self.period = min(1.0, timeout / 4)
        self._workers: dict[int, Watchdog] = {}  # by id, in the order they came
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, worker: Watchdog) -> None:
        with self._lock:
            self._workers[id(worker)] = worker
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="watchdog", daemon=True)
                self._thread.start()

    def forget(self, worker: Watchdog) -> None:
        with self._lock:
            self._workers.pop(id(worker), None)

    def _serve(self) -> None:
        while True:
            time.sleep(self.period)
            with self._lock:
                workers = list(self._workers.values())
                if not workers:
                    self._thread = None
                    return
            for worker in workers:
                worker._check()

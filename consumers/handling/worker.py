"""A partition's worker thread: handles its deliveries in order, retries, dead-letters, acks.

What happens to a delivery (every outcome is logged and counted):

- **Handled**: the handler returned; the delivery is acked.
- **Handler raised** anything, ``SystemExit`` and ``KeyboardInterrupt`` included:
  a failed attempt. Retried with backoff up to ``max_attempts`` handler attempts,
  then published to the stream's dead-letter queue (``x-partq-error-type``,
  ``x-partq-error``, ``x-partq-attempts``) and acked; the partition goes on.
- **Handler returned an awaitable** (an ``async def`` handler or async ``__call__``, or a
  sync handler returning a coroutine): it is awaited on the daemon's event loop
  (:class:`~partq.consumers.handling.runners.EventLoop`) and the outcome is the
  awaitable's: returning acks, raising is a failed attempt. Never acked before it finished.
- **Malformed partq headers** (:class:`~partq.consumers.handling.message.MalformedHeaders`): never
  handed to the handler; dead-lettered at once with ``x-partq-error-type:
  MalformedHeaders`` and ``x-partq-attempts: 0``, acked, counted
  (``partq_consumer_header_problems_total{problem="malformed"}``); the partition
  goes on. A message without partq headers (a foreign publisher's) is handled
  with ``key`` and ``published_ms`` None.
- **Wrong partition**: a ``partq-partition`` header naming another partition than
  the queue it came from is logged and counted
  (``problem="wrong_partition"``), and the message is handled.
- **Handler timeout** (``handler_timeout`` seconds): the message is dead-lettered
  (``HandlerTimeout``) and acked, the worker handles nothing more and reports
  ``handler_timeout``: the daemon leaves the group and exits non-zero
  (:mod:`partq.consumers.handling.watchdog`).
- **A resize's fence** (``x-partq-control: fence``) is recorded in etcd and acked, never
  handled; a new-layout message of a key that moved waits for its old partition's fence
  (**gated**); both: :mod:`partq.consumers.handling.fences`.
- **The worker itself fails** (any unexpected error outside the handler): the
  traceback is logged, ``partq_consumer_worker_failures_total{reason="crash"}``
  counted, and the daemon told (``on_failure``): it turns ``/readyz`` false,
  leaves the group and exits non-zero. The partition's unacked deliveries go
  back to the queue when the connection closes.

Threads. The worker thread (``partition-<p>``) takes items from ``inbox`` (a
``SimpleQueue``: deliveries and END from the pika I/O thread, STOP from the controller)
and runs the handler; with a handler timeout, the member's watchdog thread (``watchdog``)
watches ``_running`` and may dead-letter and ack the running message itself. ``_lock``
guards ``_running``, ``_timed_out``, ``handled`` and ``_first`` between them (and the
pool threads of ``partq.consumers.handling.keyed``); ``_idle``, a condition on it, wakes
the controller waiting in :meth:`Worker.wait_handlers` for the calls under way before a fence. An
awaitable goes to the member's ``EventLoop`` thread; the caller blocks on its result.
Acks, channel closes and ``finish`` go through the broker's thread-safe methods; a
failure reaches the controller through ``on_failure`` (a queued event). Read without the
lock, one value each: ``waiting_since`` and ``handled`` by the controller, ``busy`` by
the HTTP scrape, pika's ``Channel.is_open`` by this thread.
:class:`~partq.consumers.broker.deadletters.DeadLetters` is shared by the member's
workers; its lock serialises publishes. Parking a key and obeying a redrive (the base
class :class:`~partq.consumers.handling.keyparking.KeyParking`) and a resize's steps
(:class:`~partq.consumers.handling.fences.ResizeSteps`) run on the thread that handles
the message; the watchdog's (:class:`~partq.consumers.handling.watchdog.Watchdog`) on its
own thread.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from partq.consumers import metrics
from partq.consumers.broker.deadletters import DeadLetters
from partq.consumers.broker.port import END, BrokerPort, Delivery
from partq.consumers.control.resizing import ResizeGate
from partq.consumers.handling import keyparking
from partq.consumers.handling.fences import ResizeSteps, is_fence
from partq.consumers.handling.keyparking import KeyParking, Outcome
from partq.consumers.handling.message import Handler, MalformedHeaders, Message, message_from
from partq.consumers.handling.parking import Parking, shown_key
from partq.consumers.handling.runners import EventLoop
from partq.consumers.handling.watchdog import (
    CRASH,
    HANDLER_TIMEOUT,
    HandlerTimeout,
    Running,
    TimedOut,
    Watchdog,
    Watchdogs,
)
from partq.coordinator.store.session import Session
from partq.producer.contract import (
    CONTROL_FENCE,
    HEADER_CONTROL,
    HEADER_GROUP,
    StreamSpec,
    key_id,
)

from partq.kernel import logs
from partq.kernel.backoff import Backoff

__all__ = ["CRASH", "HANDLER_TIMEOUT", "DeadLetters", "HandlerTimeout", "Worker", "is_fence"]

log = logging.getLogger("partq.consumer.worker")
STOP = object()


class _Fencing(Exception):
    """The worker was stopped for a fence before the handler call began: it never begins."""


class Worker(KeyParking, ResizeSteps, Watchdog, threading.Thread):
    def __init__(
        self,
        *,
        spec: StreamSpec,
        partition: int,
        member: str,
        handler: Handler,
        broker: BrokerPort,
        session: Session,
        dead_letters: DeadLetters,
        max_attempts: int,
        retry_backoff: float,
        previous: Worker | None,
        freed_at: float | None,
        handler_timeout: float | None = None,
        on_failure: Callable[[int, str], None] | None = None,
        parking: Parking | None = None,
        loop: EventLoop | None = None,
        generation: int = 0,
        resize: ResizeGate | None = None,
        fencing_token: int = 0,
        watchdogs: Watchdogs | None = None,
    ) -> None:
        """``handler_timeout``: seconds (None or 0: none); ``watchdogs``: the member's one
        watchdog thread, which gives up on a call past it (by default the worker's own).
        ``on_failure(partition, reason)``:
        the worker stopped for good, ``reason`` :data:`CRASH` or :data:`HANDLER_TIMEOUT`.
        ``parking``: park keys (the stream's ``on_failure`` is ``park``) instead of
        dead-lettering single messages. ``loop``: where awaitables a handler returns are
        awaited (the daemon's; by default one of the worker's own, started on first use).
        ``generation``: of the subscription whose deliveries it takes
        (``partq.consumers.broker.port``).
        ``resize``: the member's gate (None: fences are acked unrecorded, nothing is gated).
        ``fencing_token``: every message's (``Message.fencing_token``): the etcd revision of
        our claim on the partition when this worker started."""
        super().__init__(name=f"partition-{partition}", daemon=True)
        self.spec = spec
        self.partition = partition
        self.member = member
        self.handler = handler
        self.broker = broker
        self.session = session
        self.dead_letters = dead_letters
        self.parking = parking
        self.max_attempts = max_attempts
        self.retries = Backoff(initial=retry_backoff)  # between handler attempts
        self.previous = previous
        self.freed_at = freed_at
        self.fencing_token = fencing_token
        self.handler_timeout = handler_timeout or None
        if watchdogs is None and self.handler_timeout is not None:
            watchdogs = Watchdogs(self.handler_timeout)
        self.watchdogs = watchdogs
        self.on_failure = on_failure
        self.loop = loop or EventLoop(name=f"handler-loop-{partition}")
        self.generation = generation
        self.resize = resize
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.stopped = threading.Event()
        self.failure: str | None = None  # why the worker stopped for good, if it did
        self._labels = (spec.scope, member)
        # labelled children looked up once: .labels() costs a lock and a dict per call
        self._m_handled_ok = metrics.HANDLED.labels(*self._labels, "ok")
        self._m_handler_seconds = metrics.HANDLER_SECONDS.labels(*self._labels)
        # guards _running, _timed_out, handled and _first (handling threads, watchdog)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when _running empties
        # the handler calls under way, by calling thread (one, unless
        # ``partq.consumers.handling.keyed``)
        self._running: dict[int, Running] = {}
        self._timed_out = False
        self._fencing = False  # stopped for a fence: no handler call begins, nothing is given back
        self._first = True  # no delivery handled yet: the next one measures the handoff gap
        self._finished = threading.Event()
        self.handled = 0  # messages handled (acked after the handler returned), for load reports
        # since when the worker has waited for its next delivery (None: it has one): a
        # partition whose worker waits while its queue has messages ready is stalled
        self.waiting_since: float | None = time.monotonic()
        self._given_back: set[int] = set()  # channels closed to return what we left unacked

    @property
    def busy(self) -> bool:
        """A handler call of this worker is under way."""
        return bool(self._running)

    def stop(self, *, fence: bool = False) -> None:
        """Stop without handling what is queued (the broker requeues it). ``fence``: the
        connection is about to be aborted (``Broker.fence``): from now on no handler call
        begins and nothing is given back by a channel close, which would serve the next
        owner newer messages first; the abort returns it all, in order."""
        if fence:
            with self._lock:
                self._fencing = True
        self.stopped.set()
        self.inbox.put(STOP)

    def wait_handlers(self, timeout: float) -> bool:
        """Wait until no handler call of this worker is under way; False if one still is
        after ``timeout`` seconds. After ``stop(fence=True)`` none begins."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._running, timeout)

    def run(self) -> None:
        with logs.bind(stream=self.spec.scope, member=self.member, partition=self.partition):
            if self.watchdogs is not None:
                self.watchdogs.watch(self)
            try:
                self._run()
            except BaseException as error:
                self._crashed(error)
            finally:
                self._finished.set()
                if self.watchdogs is not None:
                    self.watchdogs.forget(self)

    def _run(self) -> None:
        if self.previous is not None:
            self.previous.join()  # never two handlers of one partition in this process
        while True:
            self.waiting_since = time.monotonic()
            item = self.inbox.get()
            self.waiting_since = None
            if item is STOP:
                return
            if isinstance(item, tuple) and item[0] is END:
                self.broker.finish(self.partition, item[1])
                return
            if not self._process(item):
                return  # the watchdog gave up on the handler: nothing more of this partition

    def _process(self, delivery: Delivery) -> bool:
        """Everything that happens to one delivery, up to its ack (or giving it back); the
        one per-message path of both workers. False once the handler timed out: nothing
        more of the partition may be handled."""
        if self.stopped.is_set() or not self._may_handle(delivery):
            self._give_back(delivery)
            return True
        if "." in delivery.routing_key and not self._gate(delivery):
            self._give_back(delivery)  # stopped, or the channel went, while it waited
            return True
        first = False
        if self._first:  # only ever goes from True to False: the lock only the first time
            with self._lock:
                first, self._first = self._first, False
        if first and self.freed_at is not None:
            metrics.HANDOFF_GAP_SECONDS.labels(*self._labels).observe(
                max(0.0, time.time() - self.freed_at)
            )
        outcome = self._handle(delivery)
        if outcome is Outcome.ACK:
            self.broker.ack(self.partition, delivery.channel, delivery.delivery_tag)
        elif outcome is Outcome.KEEP:
            self._give_back(delivery)
        return outcome is not Outcome.TIMED_OUT

    def _give_back(self, delivery: Delivery) -> None:
        """A delivery left unacked (stopped) must not stay so on an open channel: behind
        later ones it would never be handled while the channel lives (a drained channel is
        kept for reuse). Closing the channel makes the broker requeue it; the daemon hears
        the channel is gone and subscribes again if the partition is still ours. Closing
        gracefully does not keep the order if another consumer waits on the queue: it is
        served newer messages first (docs/benchmarks.md, "Fencing"); that is why a lost
        lease is never handled here but by the daemon's fence (``Broker.fence``), which
        aborts the connection so that the next owner gets these deliveries first."""
        if self.session.lost.is_set() or self._fencing:
            return  # the fence aborts the connection (and refuses this close once begun)
        channel = delivery.channel
        if channel.is_open and id(channel) not in self._given_back:
            self._given_back.add(id(channel))
            log.info(
                "partition %d: a delivery was left unhandled: closing its channel", self.partition
            )
            self.broker.close_channel(self.partition, channel)

    def _may_handle(self, delivery: Delivery) -> bool:
        """Handle only while our lease is fresh (not right after a freeze or while etcd
        elects a leader). A stale lease is waited out until it is renewed (handle the
        delivery) or the delivery's channel closes: the daemon fences when the lease is
        lost (aborting the connection), and the broker requeues what was unacked. Skipping
        a delivery whose channel stays open would leave it unacked behind later ones,
        unhandled until the channel closes (seen: 3 messages unhandled after a kill -9 of
        the etcd leader)."""
        session = self.session
        if session.fresh() and not session.lost.is_set():
            return True  # what wait_fresh answers at once, without its lock
        while not self.session.wait_fresh(self.session.ttl):
            if self.stopped.is_set() or not delivery.channel.is_open or self.session.lost.is_set():
                # lost: the fence (partq.consumers.control.daemon) closes every channel too
                return False
        return True

    def _message(self, delivery: Delivery) -> Message:
        """The handler's view of ``delivery``; :class:`MalformedHeaders` if its partq headers
        do not parse."""
        props = delivery.properties
        return message_from(
            self.spec.name,
            self.partition,
            delivery.body,
            props.message_id,
            props.headers,
            delivery.redelivered,
            1,
            self.fencing_token,
        )

    def _handle(self, delivery: Delivery) -> Outcome:
        """Run the handler with bounded retries."""
        props = delivery.properties
        if delivery.redelivered:
            metrics.REDELIVERIES.labels(*self._labels).inc()
        try:
            message = self._message(delivery)
        except MalformedHeaders as error:
            metrics.HEADER_PROBLEMS.labels(*self._labels, "malformed").inc()
            log.error(
                "partition %d: message %s has malformed partq headers (%s): dead-lettering it "
                "unhandled",
                self.partition,
                props.message_id,
                error,
            )
            return self._dead_letter(delivery, error, 0)
        wrong = message.published_partition
        if wrong is not None and wrong != self.partition:
            metrics.HEADER_PROBLEMS.labels(*self._labels, "wrong_partition").inc()
            log.warning(
                "partition %d: message %s (key %s) says partition %d: it was published into "
                "the wrong queue, so its key's order is not guaranteed; handling it",
                self.partition,
                props.message_id,
                shown_key(message.key),
                wrong,
            )
        addressed = (props.headers or {}).get(HEADER_GROUP)
        if addressed is not None and addressed not in (self.spec.group, self.spec.group.encode()):
            metrics.HANDLED.labels(*self._labels, "other_group").inc()
            return Outcome.ACK  # a redrive or dlq request of another group (docs/groups.md)
        control = (props.headers or {}).get(HEADER_CONTROL)
        if control in (CONTROL_FENCE, CONTROL_FENCE.encode()):
            return self._fence(delivery)
        if control is not None:
            return self._control(delivery, message, control)
        key = message.key
        parking = self.parking
        if parking is not None and key is not None and parking.parked.get(key_id(key)):
            return self._park(delivery, key, None, 0)  # behind its key's earlier messages
        outcome, failure, attempts = self._attempts(delivery, message)
        if failure is None:
            return outcome
        if parking is not None and key is not None:
            refused = parking.refuse(failure)
            if refused is None:
                return self._park(delivery, key, failure, attempts)
            failure = refused  # too many parked keys: dead-lettered, the key flows on
        return self._dead_letter(delivery, failure, attempts)

    def _attempts(
        self, delivery: Delivery, message: Message, *, replay: bool = False
    ) -> tuple[Outcome, BaseException | None, int]:
        """Up to ``max_attempts`` handler calls with backoff: (ACK, None, n) once handled;
        (KEEP, failure, n) when every attempt failed (or KEEP when stopped, TIMED_OUT when
        the watchdog gave up on it, with no failure)."""
        attempt = 1
        while True:
            started = time.monotonic()
            try:
                failure = self._call(delivery, message, replay=replay)
            except TimedOut:
                return Outcome.TIMED_OUT, None, attempt
            except _Fencing:
                return Outcome.KEEP, None, attempt
            self._m_handler_seconds.observe(time.monotonic() - started)
            if failure is None:
                self._m_handled_ok.inc()  # and ``handled`` counted it (in _call)
                return Outcome.ACK, None, attempt
            if attempt >= self.max_attempts:
                return Outcome.KEEP, failure, attempt
            metrics.HANDLED.labels(*self._labels, "retry").inc()
            log.warning(
                "partition %d: handler failed (attempt %d/%d): %r",
                self.partition,
                attempt,
                self.max_attempts,
                failure,
            )
            if self.stopped.wait(self.retries.delay(attempt)):
                return Outcome.KEEP, None, attempt
            attempt += 1
            message = dataclasses.replace(message, attempt=attempt)

    def _call(
        self, delivery: Delivery, message: Message, *, replay: bool = False
    ) -> BaseException | None:
        """What the handler raised, or None; :class:`TimedOut` if the watchdog gave up on it,
        :class:`_Fencing` if the worker was stopped for a fence (the call never began)."""
        caller = threading.get_ident()
        with self._lock:
            if self._fencing:
                raise _Fencing
            self._running[caller] = Running(delivery, message, time.monotonic(), replay)
        try:
            result = self.handler(message)
            if inspect.isawaitable(result):  # the work is in it: it has run once awaited
                self.loop.wait(result)
            failure: BaseException | None = None
        except BaseException as error:  # SystemExit, KeyboardInterrupt too: a failed attempt
            failure = error
        with self._lock:
            del self._running[caller]
            if not self._running:
                self._idle.notify_all()
            if self._timed_out:
                raise TimedOut
            if failure is None:
                self.handled += 1
        return failure

    def _dead_letter(
        self, delivery: Delivery, error: BaseException, attempts: int, patience: float | None = None
    ) -> Outcome:
        """ACK once the dead letter is confirmed; KEEP if stopped (or ``patience`` ran out)."""
        delays = keyparking.RETRY_BACKOFF.delays()
        deadline = None if patience is None else time.monotonic() + patience
        while not self.stopped.is_set() and (deadline is None or time.monotonic() < deadline):
            try:
                self.dead_letters.publish(delivery, error, attempts)
            except Exception as e:  # broker trouble: keep the message, try again
                log.warning("partition %d: dead-lettering failed: %s", self.partition, e)
                self.stopped.wait(delays.next())
                continue
            metrics.HANDLED.labels(*self._labels, "dead_lettered").inc()
            metrics.DEAD_LETTERED.labels(*self._labels).inc()
            log.error(
                "partition %d: message %s dead-lettered after %d handler attempts: %r",
                self.partition,
                delivery.properties.message_id,
                attempts,
                error,
            )
            return Outcome.ACK
        return Outcome.KEEP

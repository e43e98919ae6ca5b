"""The consumer daemon: joins a stream's group and consumes the partitions assigned to it.

The controller thread handles every event (:mod:`partq.consumers.control.events`,
matched with ``match``): it keeps the member's session, its membership and its watch, and hands the
rest to :class:`partq.consumers.control.partitions.Partitions`, which mirrors the group
keys, steps each partition's pure state machine (``partq.consumers.state.handoff``) and
carries out the commands: claim/release in etcd, subscribe/cancel at the broker.

Threads. The controller is the thread that calls :meth:`Consumer.run` (the main thread
under ``partq consume``); it alone reads and writes this object and its ``Partitions``.
The others reach it only as typed events on ``events`` (a ``queue.Queue``; a stop signal
reaches it through partq.consumers.control.signals' relay thread, never from the
handler): the broker's events through its sink on the pika I/O thread
(``partq.consumers.broker.port``: ``Subscribed``, ``Drained``, ``Connection``,
``Activated``, ...), the etcd watch stream's thread (``WatchEvent``, ``WatchFailed``), the
session's keepalive thread (``LeaseLost``), worker, watchdog and pool threads
(``WorkerFailed``, ``ParkStall``), and :meth:`Consumer.stop` from any thread (``Stop``).
What the controller asks itself for later (``_after``, ``_schedule``) is no thread's: a
heap of due events it alone keeps (:class:`partq.consumers.control.deadlines.Deadlines`),
served by its own loop, which takes the queue with a timeout until the earliest is due
(``_next``). Two reads cross without the queue: the sink (``_sink``, on the I/O thread)
looks the partition's worker up in ``Partitions.workers`` (one dict lookup) and puts a
delivery or END in its ``inbox`` (a ``SimpleQueue``) only if the worker's generation is
the delivery's; the HTTP server thread reads ``ready`` and ``alive`` (``threading.Event``).

Joining only once RabbitMQ works, and leaving while it is unusable:
:mod:`partq.consumers.control.brokerlink`. A stream deleted, recreated or resized while
the consumer runs: :mod:`partq.consumers.control.streamlife`. A stop, and a failure that
stops it with an exit code: :mod:`partq.consumers.control.stopping`.

A consumer never dies silently: :meth:`Consumer.run` returns an exit code
(``partq.consumers.control.config`` lists them), which ``partq consume`` exits with.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from partq.consumers.broker import port
from partq.consumers.broker.connection import Broker
from partq.consumers.broker.port import BrokerEvent, BrokerFactory, BrokerUpdate
from partq.consumers.control.brokerlink import BrokerLink
from partq.consumers.control.config import (
    DEFAULT_HANDLER_TIMEOUT,
    EXIT_DRAIN_TIMEOUT,
    EXIT_HANDLER_TIMEOUT,
    EXIT_OK,
    EXIT_PERMISSION_DENIED,
    EXIT_STREAM_CHANGED,
    EXIT_WORKER_FAILED,
    ConsumerConfig,
    default_member_id,
)
from partq.consumers.control.crew import Crew
from partq.consumers.control.deadlines import Deadlines
from partq.consumers.control.events import (
    BrokerOutage,
    CheckFlow,
    CheckLeader,
    CheckTakeovers,
    ControllerEvent,
    GroupEvent,
    LeaveNow,
    ParkStall,
    ReportLoad,
    Resync,
    RetryRelease,
    SettleTakeover,
    StopYielding,
    TimerEvent,
    WorkerFailed,
)
from partq.consumers.control.membership import NO_LEADER_WARNING, Membership
from partq.consumers.control.partitions import Partitions
from partq.consumers.control.reports import Reports
from partq.consumers.control.resizing import ResizeGate
from partq.consumers.control.stopping import Stopping
from partq.consumers.control.streamlife import StreamLife, widest
from partq.consumers.handling.message import Handler, check_handler
from partq.consumers.handling.parking import ParkedKeys, Parking
from partq.consumers.handling.worker import DeadLetters
from partq.consumers.state.handoff import Event
from partq.consumers.state.priority import YIELD_WAIT
from partq.coordinator.store.events import LeaseLost, Stop, WatchFailed
from partq.coordinator.store.group import Group, WatchEvent
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry

from partq.kernel import logs
from partq.kernel.amqp import DEFAULT_AMQP_URL, AmqpURL
from partq.kernel.backoff import Backoff
from partq.kernel.errors import EtcdUnavailable

__all__ = [
    "DEFAULT_HANDLER_TIMEOUT",
    "EXIT_DRAIN_TIMEOUT",
    "EXIT_HANDLER_TIMEOUT",
    "EXIT_OK",
    "EXIT_PERMISSION_DENIED",
    "EXIT_STREAM_CHANGED",
    "EXIT_WORKER_FAILED",
    "Consumer",
    "ConsumerConfig",
    "default_member_id",
]

log = logging.getLogger("partq.consumer")

# The broker's events that are steps of a partition's handoff state machine
_HANDOFF: dict[type[BrokerUpdate], Event] = {
    port.Subscribed: Event.SUBSCRIBED,
    port.Drained: Event.DRAINED,
    port.Emptied: Event.EMPTIED,
    port.Kept: Event.KEPT,
    port.ChannelLost: Event.CHANNEL_LOST,
}

_BACKOFF = Backoff()  # resyncing with etcd: 0.2 s doubling to 5 s


class Consumer(BrokerLink, StreamLife, Stopping):
    """A member of a stream's group (the module docstring). ``broker``: the RabbitMQ edge's
    class, or one with its constructor and methods (``tests.fakes.broker.StubBroker``)."""

    def __init__(
        self,
        registry: Registry,
        handler: Handler,
        config: ConsumerConfig,
        *,
        amqp_url: AmqpURL = DEFAULT_AMQP_URL,
        broker: BrokerFactory = Broker,
    ) -> None:
        self.handler = check_handler(handler)  # before anything connects: a usage error
        self.registry = registry
        self.config = config
        self.member = config.member
        self.spec: StreamSpec = registry.read_spec(config.stream)
        self.spec.check_partitions(config.partitions)
        self.epoch = self.spec.epoch  # the layout's (self.spec keeps the widest count seen)
        self.spec = widest(registry, self.spec)
        self.resize = ResizeGate(
            registry.client, registry.where, config.stream, self.member, self.spec.epoch
        )
        self.group = Group(registry.client, registry.where, config.stream)
        self.events: queue.Queue[ControllerEvent] = queue.Queue()
        # what the controller asked itself for later, served by its loop (_next)
        self.deadlines: Deadlines[TimerEvent] = Deadlines()
        self.stopping = False
        self.deleted = False  # the stream is gone; waiting for it to be created again
        self.away = True  # not in the group for want of a usable broker (BrokerLink)
        self._broker_up = False
        self._outages = 0
        self.exit_code: int | None = None
        self._deadline: float | None = None
        self.ready = threading.Event()
        self.alive = threading.Event()
        self._retries = _BACKOFF.delays()  # of resyncs and releases, until a resync works
        self._labels = (self.spec.scope, self.member)
        self.dead_letters = DeadLetters(amqp_url, self.spec, self.member)
        self.parking = (
            Parking(
                amqp_url,
                self.spec,
                self.member,
                self.group,
                ParkedKeys(),
                on_stall=lambda: self.events.put(ParkStall()),
            )
            if self.spec.on_failure == "park"
            else None
        )
        put = self.events.put
        self.broker = broker(
            amqp_url,
            self.spec,
            prefetch=config.prefetch,
            heartbeat=config.heartbeat or config.ttl,
            name=f"partq-consumer-{self.member}",
            sink=self._sink,
            # Quorum queues only: a classic queue (RabbitMQ 3.10) does not activate a
            # consumer waiting behind one that cancels, so its next owner must subscribe
            # after the cancel, as before (docs/benchmarks.md, issue 12 goal 2)
            early_release=self.spec.queue_type == "quorum",
        )
        crew = Crew(
            member=self.member,
            handler=handler,
            broker=self.broker,
            dead_letters=self.dead_letters,
            max_attempts=config.max_attempts,
            retry_backoff=config.retry_backoff,
            handler_timeout=config.handler_timeout,
            on_failure=lambda p, reason: put(WorkerFailed(p, reason)),
            parking=self.parking,
            resize=self.resize,
            concurrency=config.concurrency,
            fence_wait=config.ttl,
        )
        self.partitions = Partitions(
            spec=self.spec,
            member=self.member,
            group=self.group,
            broker=self.broker,
            crew=crew,
            retry_release=lambda p: self._schedule(RetryRelease(p)),
            resync=lambda: self._schedule(Resync()),
            settle_takeover=lambda p: self._after(config.ttl + 1.0, SettleTakeover(p)),
            stop_yielding=lambda p, since: self._after(YIELD_WAIT, StopYielding(p, since)),
            parking=self.parking,
        )
        self.reports = Reports(
            config, self._labels, self.group, self.partitions, self.broker, self.parking
        )
        self.membership = Membership(registry, self.group, config, self.partitions, put)

    @property
    def session(self) -> Session | None:
        """The member's current session (None: not in the group)."""
        return self.membership.session

    # -- public --------------------------------------------------------------------------

    def stop(self) -> None:
        """Drain, release claims, revoke the lease, return from :meth:`run`."""
        self.events.put(Stop())

    def owned(self) -> list[int]:
        return self.partitions.owned()

    def run(self) -> int:
        """Consume until :meth:`stop` or a failure; the exit code (the module docstring).

        0 after a clean drain, 1 if the drain deadline passed, 3/4/5 after a failure.
        """
        with logs.bind(stream=self.spec.scope, member=self.member):
            return self._run()

    def _run(self) -> int:
        self.alive.set()
        self.broker.start()
        self.resize.start()
        log.info("waiting for a usable RabbitMQ connection before joining %s", self.spec.scope)
        if self.config.load_report > 0:
            self._after(self.config.load_report, ReportLoad())
        if self.config.stall_after > 0:
            self._after(self.config.stall_after / 3, CheckFlow())
        try:
            while (event := self._next()) is not None:
                self._on(event)
                if self.stopping and self.partitions.idle():
                    return EXIT_OK if self.exit_code is None else self.exit_code
            log.error("drain deadline of %ss passed; exiting", self.config.drain_timeout)
            return EXIT_DRAIN_TIMEOUT if self.exit_code is None else self.exit_code
        finally:
            self._shutdown()

    def _next(self) -> ControllerEvent | None:
        """A deadline of ours come due, else the queue's next, taken with a timeout until
        the earliest deadline; None once the queue stays empty past the drain deadline."""
        while (event := self.deadlines.pop()) is None:
            try:
                return self.events.get(timeout=self.deadlines.timeout(self._deadline))
            except queue.Empty:
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    return None
        return event

    # -- events --------------------------------------------------------------------------

    def _sink(self, event: BrokerEvent) -> None:
        """The broker's events (on its I/O thread): a delivery or END goes straight to its
        partition's worker, if that worker is of the subscription it came from; anything
        else is queued for the controller."""
        if isinstance(event, port.Delivery):  # the per-message path: no pattern to match
            self._route(event.partition, event.generation, event)
        elif isinstance(event, port.End):
            self._route(event.partition, event.generation, (port.END, event.channel))
        else:
            self.events.put(event)

    def _route(self, partition: int, generation: int, item: object) -> None:
        """One dict lookup of a worker the controller may replace meanwhile: an item of an
        older subscription never reaches a newer worker (nor a newer one an older)."""
        worker = self.partitions.workers.get(partition)
        if worker is not None and worker.generation == generation:
            worker.inbox.put(item)

    def _on(self, event: ControllerEvent) -> None:
        """One event: the broker's, a timer's, or the group's and the session's."""
        if isinstance(event, BrokerUpdate):
            self._on_broker_event(event)
        elif isinstance(event, TimerEvent):
            self._on_timer(event)
        else:
            self._on_group(event)

    def _on_group(self, event: GroupEvent) -> None:
        """The group's and the session's events, and the retries of what they failed."""
        match event:
            case Stop():
                self._begin_stop()
            case WatchEvent(kind="spec", value=spec):
                self._on_spec(spec if isinstance(spec, StreamSpec) else None)
            case WatchEvent():
                # a recreated stream is read afresh (_resync), and so is the group on a rejoin
                if not self.deleted and not self.away:
                    self._grow_early(event)
                    self.partitions.apply(event)
                    self.membership.saw(event)
            case WatchFailed(error=error):
                if not self.stopping:
                    log.warning("etcd watch failed: %s; consuming on, resyncing", error)
                    self._schedule(Resync())
            case LeaseLost(lease=lease):
                session = self.membership.session
                if lease and (session is None or session.id != lease):
                    log.debug("lease %x was lost, but it is not ours any more", lease)
                else:
                    self._fence()
            case WorkerFailed(partition=partition, reason=reason):
                self._worker_failed(partition, reason)
            case ParkStall():
                self._update_ready()
            case CheckTakeovers():
                allowed = not (self.stopping or self.deleted or self.session is None)
                self.partitions.standbys.check(allowed=allowed)

    def _on_broker_event(self, event: BrokerUpdate) -> None:
        match event:
            case (
                port.Subscribed(p)
                | port.Drained(p)
                | port.Emptied(p)
                | port.Kept(p)
                | port.ChannelLost(p)
            ):
                self.partitions.handoff(p, _HANDOFF[type(event)])
            case port.Activated(partition) | port.StandbyLost(partition):
                if self.stopping or self.deleted or self.session is None:
                    self.broker.give_back(partition)
                elif isinstance(event, port.StandbyLost):
                    self.partitions.standbys.lost(partition)
                elif self.partitions.standbys.activated(partition):
                    self.events.put(CheckTakeovers())
            case port.Refused(partition, reason):
                self.partitions.abandon(partition)  # never subscribed again: it would spin
                self._fail(EXIT_PERMISSION_DENIED, reason)
            case port.Connection(up):
                self._on_broker(up)
            case port.ReadyCounts(ready):
                self.reports.flow_ready(ready)

    def _on_timer(self, event: TimerEvent) -> None:
        """What the controller asked itself to do later (``_after``)."""
        match event:
            case CheckLeader(lease=lease):
                self.membership.check_leader(lease, quiet=self.stopping or self.deleted)
            case Resync():
                if self.deleted or not self.away:  # away: the rejoin reads the group afresh
                    self._resync()
            case RetryRelease(partition=partition):
                if not self.deleted:  # deleted: the claim went with the stream
                    self.partitions.release(partition)
            case SettleTakeover() | StopYielding():
                self.partitions.later(event)
            case LeaveNow():
                if self.stopping and not self.partitions.leaving:
                    log.info("stop announced %.0fs ago: leaving now", self.config.announce_wait)
                    self._leave_now()
            case ReportLoad():
                self.reports.report_load(None if self.stopping or self.deleted else self.session)
                self._after(self.config.load_report, ReportLoad())
            case CheckFlow():
                self.reports.check_flow()
                self._after(self.config.stall_after / 3, CheckFlow())
            case BrokerOutage(outage=outage):
                self._leave_for_broker(outage)

    def _after(self, seconds: float, event: TimerEvent) -> None:
        """Handle ``event`` ``seconds`` from now, on this thread (``deadlines``)."""
        self.deadlines.after(seconds, event)

    def _schedule(self, event: Resync | RetryRelease) -> None:
        """Handle ``event`` after the next backoff delay."""
        self.deadlines.after(self._retries.next(), event)

    # -- membership, sessions, fencing ---------------------------------------------------

    def _join(self) -> None:
        """New session, register the member, mirror the group (retrying while etcd is down)."""
        session = self.membership.join()
        self._resync()
        self._after(NO_LEADER_WARNING, CheckLeader(session.id))

    def _resync(self) -> None:
        try:
            state = self.membership.watch()
            # a deletion the watch may not have seen
            exists = self.membership.read_spec() is not None
        except EtcdUnavailable as e:
            log.warning("cannot read the group from etcd: %s; consuming on", e)
            self._schedule(Resync())
            return
        self._retries.reset()
        if not exists:
            self._stream_deleted()
            return
        if self.deleted:
            self._stream_recreated()
            return
        self.partitions.follow(state)  # the watch starts after the snapshot: nothing older
        self._update_ready()

    def _fence(self) -> None:
        """Our lease is gone: others may own our partitions now. Stop at once, then rejoin."""
        if self.deleted:
            return  # the session was closed on purpose
        log.warning("lease lost: stopping every partition and rejoining")
        self.ready.clear()
        self.partitions.drop()
        self.membership.end(revoke=False, forget=False)  # a rejoin replaces it
        if not self.stopping:
            self._join_when_usable()

    def _update_ready(self) -> None:
        healthy = not self.stopping and not self.deleted and self.exit_code is None
        if self.parking is not None and self.parking.stalls.stalled():
            healthy = False  # a partition waits for a park: ParkStalls logs why
        if healthy and self.broker.connected.is_set() and self.session is not None:
            self.ready.set()
        else:
            self.ready.clear()

    def _shutdown(self) -> None:
        self.ready.clear()
        self.membership.unwatch()
        self.partitions.stop_workers()
        self.partitions.close()
        self.resize.close()
        self.broker.stop()
        self.broker.join(timeout=5)
        if self.parking is not None:
            self.parking.close()
        self.membership.end(revoke=True)
        self.alive.clear()

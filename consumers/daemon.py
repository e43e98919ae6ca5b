"""The consumer daemon: joins a stream's group and consumes the partitions assigned to it.

One controller thread owns all state. etcd watch events, broker callbacks,
worker reports and signals reach it through one queue; it steps each
partition's pure state machine (``consumers.handoff``) and carries out the
commands: claim/release in etcd, subscribe/cancel at the broker.

A consumer never dies silently. :meth:`Consumer.run` returns an exit code
(``partq consume`` exits with it):

- 0 (:data:`EXIT_OK`): stopped on request, every partition drained.
- 1 (:data:`EXIT_DRAIN_TIMEOUT`): stopped, but the drain deadline passed.
- 3 (:data:`EXIT_HANDLER_TIMEOUT`): a handler ran past ``handler_timeout``. Its
  message was dead-lettered (``HandlerTimeout``); the member left the group.
- 4 (:data:`EXIT_WORKER_FAILED`): a partition worker failed (traceback logged,
  ``partq_consumer_worker_failures_total{reason="crash"}``); the member left the group.
- 5 (:data:`EXIT_STREAM_CHANGED`): the stream was deleted and recreated with another
  partition count; partitions are fixed, so this member cannot go on.

On 3 and 4, ``/readyz`` turns false at once; the other partitions are drained
and released as on a stop, the failed one is abandoned (its unacked deliveries
return to the queue when the connection closes, before the lease is revoked):
the partition moves to another member and the supervisor restarts this one.

A stream deleted while the consumer runs: ``/readyz`` turns false, a log line
says so, every partition stops (the queues are gone) and the member waits,
without a lease, for the stream to be created again; then it rejoins (or exits
with 5 if the partition count changed).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from consumers import metrics
from consumers.broker import Broker, Delivery
from consumers.handoff import Command, Event, Holder, Phase, State, step
from consumers.message import Handler
from consumers.worker import HANDLER_TIMEOUT, DeadLetters, Worker
from coordinator.group import Assignment, Claim, Group, WatchEvent, validate_member_id
from coordinator.session import Session
from kernel import logs
from kernel.amqp import DEFAULT_AMQP_URL, AmqpURL
from kernel.errors import EtcdUnavailable, StreamNotFound
from producer.contract import StreamSpec
from producer.registry import Registry

__all__ = [
    "EXIT_DRAIN_TIMEOUT",
    "EXIT_HANDLER_TIMEOUT",
    "EXIT_OK",
    "EXIT_STREAM_CHANGED",
    "EXIT_WORKER_FAILED",
    "Consumer",
    "ConsumerConfig",
]

log = logging.getLogger("partq.consumer")

EXIT_OK = 0
EXIT_DRAIN_TIMEOUT = 1
EXIT_HANDLER_TIMEOUT = 3
EXIT_WORKER_FAILED = 4
EXIT_STREAM_CHANGED = 5
# A handler may run this long per message by default: far longer than any per-message
# work should take, and well below RabbitMQ's consumer_timeout (30 min by default), past
# which the broker itself would close the channel and return the partition's messages.
DEFAULT_HANDLER_TIMEOUT = 300.0


@dataclass(frozen=True)
class ConsumerConfig:
    stream: str
    member_id: str | None = None
    weight: int = 1
    prefetch: int = 100
    ttl: int = 5
    heartbeat: int | None = None  # AMQP heartbeat; default: the lease TTL
    max_attempts: int = 5
    retry_backoff: float = 0.1
    drain_timeout: float = 20.0
    partitions: int | None = None  # expected partition count; refused if etcd differs
    version: str = "0.1.0"
    # Seconds a handler may run per message (None or 0: no limit). Past it the message is
    # dead-lettered and the member exits with EXIT_HANDLER_TIMEOUT (see the module docstring).
    handler_timeout: float | None = DEFAULT_HANDLER_TIMEOUT

    def __post_init__(self) -> None:
        if self.member_id is not None:  # InvalidMemberId: a usage error, exit code 2
            validate_member_id(self.member_id)
        if self.weight < 1:
            raise ValueError(f"weight must be at least 1, got {self.weight}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {self.prefetch}")
        if self.max_attempts < 1:
            raise ValueError(f"max attempts must be at least 1, got {self.max_attempts}")
        if self.handler_timeout is not None and not self.handler_timeout >= 0:
            raise ValueError(f"handler timeout must be 0 or more, got {self.handler_timeout}")

    @property
    def member(self) -> str:
        return self.member_id or default_member_id()


def default_member_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


class Consumer:
    def __init__(
        self,
        registry: Registry,
        handler: Handler,
        config: ConsumerConfig,
        *,
        amqp_url: AmqpURL = DEFAULT_AMQP_URL,
    ) -> None:
        self.registry = registry
        self.handler = handler
        self.config = config
        self.member = config.member
        self.spec: StreamSpec = registry.read_spec(config.stream)
        self.spec.check_partitions(config.partitions)
        self.group = Group(registry.client, registry.where, config.stream)
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.states = {p: State() for p in range(self.spec.partitions)}
        self.assignment: dict[int, str] = {}
        self.claims: dict[int, Claim] = {}
        # partition -> etcd revision of our latest own claim write: older watch events are stale
        self.claim_revisions: dict[int, int] = {}
        self.workers: dict[int, Worker] = {}
        # Workers stopped but maybe still in their handler: the partition's next worker
        # waits for them (one handler per partition in this process, also after a fence).
        self.retired: dict[int, Worker] = {}
        self.freed_at: dict[int, float] = {}
        self.session: Session | None = None
        self.watch_id: int | None = None
        self.stopping = False
        self.deleted = False  # the stream is gone; waiting for it to be created again
        self.exit_code: int | None = None  # set by a failure: run() returns it
        self.abandoned: set[int] = set()  # partitions whose worker failed: not drained
        self._deadline: float | None = None
        self.ready = threading.Event()
        self.alive = threading.Event()
        self._resync_backoff = 0.2
        self._labels = (self.spec.name, self.member)
        self.dead_letters = DeadLetters(amqp_url, self.spec, self.member)
        self.broker = Broker(
            amqp_url, self.spec,
            prefetch=config.prefetch,
            heartbeat=config.heartbeat or config.ttl,
            name=f"partq-consumer-{self.member}",
            deliver=self._deliver,
            on_subscribed=lambda p: self.events.put(("part", p, Event.SUBSCRIBED)),
            on_drained=lambda p: self.events.put(("part", p, Event.DRAINED)),
            on_channel_lost=lambda p: self.events.put(("part", p, Event.CHANNEL_LOST)),
            on_connection=lambda up: self.events.put(("broker", up)),
        )  # fmt: skip

    # -- public --------------------------------------------------------------------------

    def stop(self) -> None:
        """Drain, release claims, revoke the lease, return from :meth:`run`."""
        self.events.put(("stop",))

    def owned(self) -> list[int]:
        return sorted(p for p, s in self.states.items() if s.phase is Phase.ACTIVE)

    def run(self) -> int:
        """Consume until :meth:`stop` or a failure; the exit code (the module docstring).

        0 after a clean drain, 1 if the drain deadline passed, 3/4/5 after a failure.
        """
        with logs.bind(stream=self.spec.name, member=self.member):
            return self._run()

    def _run(self) -> int:
        self.alive.set()
        self.broker.start()
        self._join()
        try:
            while True:
                deadline = self._deadline
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    event = self.events.get(timeout=timeout)
                except queue.Empty:
                    log.error("drain deadline of %ss passed; exiting", self.config.drain_timeout)
                    return EXIT_DRAIN_TIMEOUT if self.exit_code is None else self.exit_code
                if event[0] == "stop":
                    self._begin_stop()
                else:
                    self._on(event)
                if self.stopping and all(
                    s.phase is Phase.IDLE or p in self.abandoned for p, s in self.states.items()
                ):
                    return EXIT_OK if self.exit_code is None else self.exit_code
        finally:
            self._shutdown()

    # -- events --------------------------------------------------------------------------

    def _deliver(self, partition: int, item: Delivery | object) -> None:
        worker = self.workers.get(partition)
        if worker is not None:
            worker.inbox.put(item)

    def _on(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "watch":
            if event[1].kind == "spec":
                self._on_spec(event[1])
            elif not self.deleted:  # a recreated stream is read afresh (_resync)
                self._apply(event[1])
        elif kind == "watch-error":
            if not self.stopping:
                log.warning("etcd watch failed: %s; consuming on, resyncing", event[1])
                self._schedule("resync")
        elif kind == "resync":
            self._resync()
        elif kind == "lease-lost":
            if not self.deleted:  # deleted: the session was closed on purpose
                self._fence()
        elif kind == "part":
            self._feed(event[1], event[2])
        elif kind == "retry-release":
            if not self.deleted:  # deleted: the claim went with the stream
                self._run_command(event[1], Command.RELEASE)
        elif kind == "worker-failed":
            self._worker_failed(event[1], event[2])
        elif kind == "broker":
            if event[1]:
                self._resubscribe()
            self._update_ready()

    def _apply(self, change: WatchEvent) -> None:
        """Mirror one decoded change; a malformed value (``value`` None) is an absent key."""
        if change.kind == "assignment":
            partition = change.partition
            if isinstance(change.value, Assignment):
                self.assignment[partition] = change.value.owner
            else:
                self.assignment.pop(partition, None)
            self._sync(partition)
        elif change.kind == "claim":
            partition = change.partition
            if change.revision <= self.claim_revisions.get(partition, 0):
                return  # older than our own claim/release, which the mirror already has
            if isinstance(change.value, Claim):
                self.claims[partition] = change.value
            else:
                self.claims.pop(partition, None)
            self._sync(partition)

    def _holder(self, partition: int) -> Holder:
        claim = self.claims.get(partition)
        if claim is None:
            return Holder.NOBODY
        return Holder.ME if self.session and claim.lease == self.session.id else Holder.OTHER

    def _sync(self, partition: int) -> None:
        """Feed the state machine whatever differs between it and the mirror."""
        if partition >= self.spec.partitions:
            return
        state = self.states[partition]
        assigned = self.assignment.get(partition) == self.member and not self.stopping
        if assigned != state.assigned:
            self._feed(partition, Event.ASSIGNED if assigned else Event.UNASSIGNED)
        holder = self._holder(partition)
        state = self.states[partition]
        if holder is not state.holder:
            if holder is Holder.NOBODY:
                self.freed_at[partition] = time.time()
                self._feed(partition, Event.CLAIM_FREE)
            elif holder is Holder.OTHER:
                self._feed(partition, Event.CLAIM_OTHER)

    def _feed(self, partition: int, event: Event) -> None:
        before = self.states[partition]
        after, commands = step(before, event)
        self.states[partition] = after
        if before.phase is not after.phase:
            log.debug(
                "partition %d: %s -> %s on %s",
                partition,
                before.phase.value,
                after.phase.value,
                event.value,
            )
        if after.phase is Phase.ACTIVE and before.phase is not Phase.ACTIVE:
            metrics.HANDOFFS.labels(*self._labels, "acquired").inc()
            log.info("partition %d: consuming", partition)
        if before.phase is Phase.DRAINING and after.phase is not Phase.DRAINING:
            metrics.HANDOFFS.labels(*self._labels, "released").inc()
            log.info("partition %d: drained and released", partition)
        metrics.PARTITIONS_OWNED.labels(*self._labels).set(len(self.owned()))
        for command in commands:
            self._run_command(partition, command)

    def _run_command(self, partition: int, command: Command) -> None:
        session = self.session
        if partition in self.abandoned and command in (Command.SUBSCRIBE, Command.CANCEL):
            return  # its worker failed: nothing is handled or drained there any more
        if command is Command.SUBSCRIBE:
            old = self.workers.get(partition) or self.retired.pop(partition, None)
            if old is not None:
                old.stop()
            worker = Worker(
                spec=self.spec, partition=partition, member=self.member, handler=self.handler,
                broker=self.broker, session=session,  # type: ignore[arg-type]
                dead_letters=self.dead_letters, max_attempts=self.config.max_attempts,
                retry_backoff=self.config.retry_backoff, previous=old,
                freed_at=self.freed_at.pop(partition, None),
                handler_timeout=self.config.handler_timeout,
                on_failure=lambda p, reason: self.events.put(("worker-failed", p, reason)),
            )  # fmt: skip
            self.workers[partition] = worker
            worker.start()
            if not self.broker.subscribe(partition):
                log.info("partition %d: subscribing once RabbitMQ is back", partition)
        elif command is Command.CANCEL:
            self.broker.cancel(partition)
        elif command is Command.CLAIM:
            assert session is not None
            try:
                revision = self.group.claim(partition, self.member, session)
            except EtcdUnavailable as e:
                log.warning("partition %d: cannot claim: %s", partition, e)
                revision = 0
                self._schedule("resync")
            ok = revision > 0
            if ok:  # mirror our own write now: the watch echoes it later
                self.claims[partition] = Claim(self.member, session.id)
                self.claim_revisions[partition] = revision
            self._feed(partition, Event.CLAIMED if ok else Event.CLAIM_REFUSED)
        elif command is Command.RELEASE:
            released = self.workers.pop(partition, None)
            if released is not None:
                released.stop()
                self.retired[partition] = released
            assert session is not None
            try:
                revision = self.group.release(partition, session)
            except EtcdUnavailable as e:
                log.warning("partition %d: cannot release the claim yet: %s", partition, e)
                self._schedule("retry-release", partition)
                return
            if revision > 0:  # mirror our own delete now, as for a claim
                self.claims.pop(partition, None)
                self.claim_revisions[partition] = revision
            self._feed(partition, Event.RELEASED)

    def _schedule(self, kind: str, *args: Any) -> None:
        delay = self._resync_backoff
        self._resync_backoff = min(self._resync_backoff * 2, 5.0)
        timer = threading.Timer(delay, self.events.put, args=((kind, *args),))
        timer.daemon = True
        timer.start()

    # -- membership, sessions, fencing ---------------------------------------------------

    def _join(self) -> None:
        """New session, register the member, mirror the group (retrying while etcd is down)."""
        backoff = 0.2
        while True:
            try:
                self.session = Session(
                    self.registry.client, self.registry.where, self.config.ttl,
                    on_lost=lambda: self.events.put(("lease-lost",)),
                    on_renewal_failure=metrics.LEASE_RENEWAL_FAILURES.labels(*self._labels).inc,
                )  # fmt: skip
                self.group.join(self.session, self.member, self.config.weight, self.config.version)
                break
            except EtcdUnavailable as e:
                log.warning("cannot join %s: %s; retrying in %.1fs", self.spec.name, e, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        log.info("joined %s as %s (lease %x)", self.spec.name, self.member, self.session.id)
        self._resync()

    def _resync(self) -> None:
        if self.watch_id is not None:
            self.group.cancel_watch(self.watch_id)
            self.watch_id = None
        try:
            state = self.group.snapshot()
            self.watch_id = self.group.watch(
                state.revision,
                lambda e: self.events.put(
                    ("watch-error", e) if isinstance(e, Exception) else ("watch", e)
                ),
            )
            exists = self._read_spec() is not None  # a deletion the watch may not have seen
        except EtcdUnavailable as e:
            log.warning("cannot read the group from etcd: %s; consuming on", e)
            self._schedule("resync")
            return
        self._resync_backoff = 0.2
        if not exists:
            self._stream_deleted()
            return
        if self.deleted:
            self._stream_recreated()
            return
        self.assignment = dict(state.assignment)
        self.claims = dict(state.claims)
        self.claim_revisions = {}  # the watch starts after the snapshot: nothing older arrives
        for partition in range(self.spec.partitions):
            self._sync(partition)
        self._update_ready()

    def _fence(self) -> None:
        """Our lease is gone: others may own our partitions now. Stop at once, then rejoin."""
        log.warning("lease lost: stopping every partition and rejoining")
        self.ready.clear()
        self._drop_partitions()
        if self.session is not None:
            self.session.close(revoke=False)
        if not self.stopping:
            self._join()

    def _drop_partitions(self) -> None:
        """Stop every partition now, without a drain: the broker requeues what was unacked."""
        self.broker.close_all()
        for partition, worker in self.workers.items():
            worker.stop()
            self.retired[partition] = worker
        self.workers.clear()
        self.states = {p: State() for p in range(self.spec.partitions)}
        metrics.PARTITIONS_OWNED.labels(*self._labels).set(0)

    # -- failures and a deleted stream -----------------------------------------------------

    def _worker_failed(self, partition: int, reason: str) -> None:
        """A worker stopped for good (it logged why): abandon its partition, leave, exit."""
        self.abandoned.add(partition)
        if reason == HANDLER_TIMEOUT:
            self._fail(EXIT_HANDLER_TIMEOUT, f"partition {partition}: a handler timed out")
        else:
            self._fail(EXIT_WORKER_FAILED, f"partition {partition}: its worker failed")

    def _fail(self, code: int, why: str) -> None:
        """Not ready from now on; leave the group as on a stop; :meth:`run` returns ``code``."""
        if self.exit_code is None:
            self.exit_code = code
        log.error("%s: leaving the group, then exiting with code %d", why, self.exit_code)
        self.ready.clear()
        self._begin_stop()

    def _read_spec(self) -> StreamSpec | None:
        """The stream's spec in etcd now, None if it is gone; raises EtcdUnavailable."""
        try:
            return self.registry.read_spec(self.spec.name)
        except StreamNotFound:
            return None

    def _on_spec(self, change: WatchEvent) -> None:
        if change.value is None:
            self._stream_deleted()
        elif self.deleted:
            self._stream_recreated()

    def _stream_deleted(self) -> None:
        """The stream's keys and queues are gone: stop everything, wait for it to come back."""
        if self.deleted:
            return
        self.deleted = True
        self.ready.clear()
        log.warning(
            "stream %s was deleted: stopped consuming; waiting for it to be recreated "
            "(not ready until then)", self.spec.name,
        )  # fmt: skip
        self._drop_partitions()
        self.assignment.clear()
        self.claims.clear()
        self.claim_revisions.clear()
        if self.session is not None:  # our member key and claims went with the stream
            self.session.close(revoke=True)
            self.session = None

    def _stream_recreated(self) -> None:
        try:
            spec = self._read_spec()
        except EtcdUnavailable as e:
            log.warning("cannot read the recreated stream's spec: %s; retrying", e)
            self._schedule("resync")
            return
        if spec is None or not self.deleted or self.stopping:
            return  # deleted again meanwhile, or going away anyway
        if spec.partitions != self.spec.partitions:
            self._fail(
                EXIT_STREAM_CHANGED,
                f"stream {spec.name} was recreated with {spec.partitions} partitions, not "
                f"{self.spec.partitions}: partitions are fixed, restart this member",
            )
            return
        log.info("stream %s was recreated: rejoining its group", spec.name)
        self.deleted = False
        self._join()

    def _begin_stop(self) -> None:
        if self.stopping:
            return
        draining = [p for p in self.owned() if p not in self.abandoned]
        log.info(
            "stopping: leaving the group and draining %d partitions%s", len(draining),
            f" (abandoning {sorted(self.abandoned)})" if self.abandoned else "",
        )  # fmt: skip
        self.stopping = True
        self._deadline = time.monotonic() + self.config.drain_timeout
        self.ready.clear()
        if self.session is not None:
            try:
                self.group.leave(self.member, self.session)
            except EtcdUnavailable as e:
                log.warning("cannot leave the group in etcd: %s", e)
        for partition in range(self.spec.partitions):
            self._sync(partition)

    def _resubscribe(self) -> None:
        """The broker is back: subscribe what was waiting for it."""
        for partition, state in sorted(self.states.items()):
            if state.phase is Phase.SUBSCRIBING:
                self.broker.subscribe(partition)

    def _update_ready(self) -> None:
        healthy = not self.stopping and not self.deleted and self.exit_code is None
        if healthy and self.broker.connected.is_set() and self.session is not None:
            self.ready.set()
        else:
            self.ready.clear()

    def _shutdown(self) -> None:
        self.ready.clear()
        if self.watch_id is not None:
            self.group.cancel_watch(self.watch_id)
        for worker in self.workers.values():
            worker.stop()
        self.broker.stop()
        self.broker.join(timeout=5)
        if self.session is not None:
            self.session.close(revoke=True)
        self.alive.clear()

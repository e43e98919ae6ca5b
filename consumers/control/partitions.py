"""The partitions of one consumer: the group mirror, and one slot per partition.

:class:`Partitions` belongs to the daemon's controller thread (``partq.consumers.control.daemon``),
which hands it watch events and the broker's events. It keeps the stream's group keys in
a :class:`partq.coordinator.store.mirror.GroupMirror` and each partition's state machine
(:func:`partq.consumers.state.handoff.step`) in step with it, and carries out the machines'
commands: claim and release in etcd, subscribe and cancel at the broker, start and
stop the partition's worker, stand by, take over or give back as its hot standby.

Without recursion, as a work list: stepping a partition yields commands, running a
command may yield a follow-up event (its outcome: claimed, refused, released), and
each is processed in turn until nothing follows.

Everything about one partition is one :class:`partq.consumers.control.slot.PartitionSlot`, kept in
one mapping, replaced whole when a resize adds partitions and never changed in place
(``slots``); its state changes only by a
step of its state machine, the hot standby's phases included.

Threads. Every method runs on the controller thread, which owns the mirror and writes
the slots. Other threads only read: the pika I/O thread looks a worker up
(``workers.get``, in ``Consumer._deliver``: one dict lookup and one attribute read); the
HTTP server thread's Prometheus scrape calls :meth:`in_flight` and ``_longest_wait``,
which read each slot's ``worker`` once and then its ``busy`` / ``longest_wait``, or the
pool's ``busy``. The broker is driven only through its thread-safe methods, and a worker,
once started here, reaches the controller only through ``on_worker_failure`` (a queued
event). The member's :class:`HandlerPool` and :class:`EventLoop` are made and closed
here, and used by the workers' threads.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from partq.consumers import metrics
from partq.consumers.broker.deadletters import DeadLetters
from partq.consumers.broker.port import BrokerPort
from partq.consumers.control.events import SettleTakeover, StopYielding
from partq.consumers.control.resizing import ResizeGate
from partq.consumers.control.slot import PartitionSlot, WorkerView
from partq.consumers.handling.keyed import KeyedWorker
from partq.consumers.handling.message import Handler
from partq.consumers.handling.parking import Parking, written_by_holder
from partq.consumers.handling.runners import EventLoop, HandlerPool
from partq.consumers.handling.worker import Worker
from partq.consumers.state import priority, standby
from partq.consumers.state.handoff import Command, Event, Holder, Phase, Standby, State
from partq.coordinator.leader import policy
from partq.coordinator.store.group import Claim, Group, GroupState, Member, Parked, WatchEvent
from partq.coordinator.store.mirror import GroupMirror
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec

from partq.kernel.errors import EtcdPermissionDenied, EtcdUnavailable

__all__ = ["Partitions"]

log = logging.getLogger("partq.consumer")


@dataclass(frozen=True, slots=True)
class _Step:
    """Feed ``event`` to the partition's state machine."""

    partition: int
    event: Event


@dataclass(frozen=True, slots=True)
class _Do:
    """Carry out a command of the partition's state machine."""

    partition: int
    command: Command


_STANDBY_COMMANDS = frozenset(
    {Command.STAND_BY, Command.STAND_DOWN, Command.GIVE_BACK, Command.PROMOTE}
)
# How many of the owner's rewrites that seal nothing an heir's takeover follows (a live mark,
# a takeover made ordinary: at most two in a claim's life) before it gives back.
_REWRITES = 3


class Partitions:
    """Every partition of the stream, from this member's side (the module docstring)."""

    def __init__(
        self,
        *,
        spec: StreamSpec,
        member: str,
        group: Group,
        broker: BrokerPort,
        handler: Handler,
        dead_letters: DeadLetters,
        max_attempts: int,
        retry_backoff: float,
        handler_timeout: float | None,
        on_worker_failure: Callable[[int, str], None],
        retry_release: Callable[[int], None],
        resync: Callable[[], None],
        settle_takeover: Callable[[int], None] = lambda _p: None,
        stop_yielding: Callable[[int, float], None] = lambda _p, _since: None,
        parking: Parking | None = None,
        concurrency: int = 1,
        resize: ResizeGate | None = None,
        fence_wait: float = 0.0,
    ) -> None:
        """``concurrency``: 1, one message at a time per partition (:class:`Worker`); above
        1, messages of different keys at once, at most that many in the member
        (:class:`KeyedWorker` on one :class:`HandlerPool`). ``fence_wait``: seconds
        :meth:`drop` waits for the handler calls under way before it fences."""
        self.spec = spec
        self.member = member
        self.group = group
        self.broker = broker
        self.handler = handler
        self.dead_letters = dead_letters
        self.parking = parking  # None: the stream dead-letters instead of parking keys
        self.resize = resize  # the resize gate every worker asks (None: no gate)
        self.max_attempts = max_attempts
        self.retry_backoff = retry_backoff
        self.handler_timeout = handler_timeout
        self.fence_wait = fence_wait  # seconds drop() waits for handler calls under way
        self._on_worker_failure = on_worker_failure
        self._retry_release = retry_release
        self._resync = resync
        self._settle_takeover = settle_takeover  # calls settle_takeover(p) a lease TTL later
        self._stop_yielding = stop_yielding  # calls stop_yielding(p, since) YIELD_WAIT later
        self.session: Session | None = None  # the member's current session (None: none)
        # planned handoffs by consumer priority (partq.consumers.state.priority): the setting
        # allows it
        # and the broker switches; set by the daemon on each connection, before joining
        self.priority = False
        self.leaving = False  # the member is stopping: nothing counts as assigned to it
        self.mirror = GroupMirror()
        self.slots = {p: PartitionSlot(p) for p in range(spec.partitions)}
        self.workers: Mapping[int, Worker] = WorkerView(self.slots)
        self._generations = itertools.count(1)  # of subscriptions: one per worker started
        self._labels = (spec.name, member)
        self.loop = EventLoop()  # awaits what async handlers return, for every partition
        self.pool = HandlerPool(concurrency, f"handler-{member}") if concurrency > 1 else None
        metrics.CONCURRENCY.labels(*self._labels).set(concurrency)
        metrics.IN_FLIGHT_MEMBER.labels(*self._labels).set_function(self.in_flight)
        metrics.KEY_WAIT_SECONDS.labels(*self._labels).set_function(self._longest_wait)

    def in_flight(self) -> int:
        """Messages of this member in a handler now (one per busy worker without a pool)."""
        if self.pool is not None:
            return self.pool.busy
        return sum(1 for worker in self._current_workers() if worker.busy)

    def _longest_wait(self) -> float:
        workers = self._current_workers()
        return max((w.longest_wait for w in workers if isinstance(w, KeyedWorker)), default=0.0)

    def _current_workers(self) -> list[Worker]:
        """Each slot's worker, read once (also from the HTTP server thread)."""
        return [w for w in (slot.worker for slot in self.slots.values()) if w is not None]

    def close(self) -> None:
        """The member is done: end the handler pool's threads and the event loop."""
        if self.pool is not None:
            self.pool.close()
        self.loop.close()

    # -- what the daemon asks ------------------------------------------------------------

    def owned(self) -> list[int]:
        """Ours and consumed (YIELDING too: consumed until its heir takes it over)."""
        return [
            p
            for p, slot in self.slots.items()
            if slot.state.phase in (Phase.ACTIVE, Phase.YIELDING)
        ]

    @property
    def abandoned(self) -> frozenset[int]:
        """The partitions whose worker failed."""
        return frozenset(p for p, slot in self.slots.items() if slot.abandoned)

    def idle(self) -> bool:
        """Nothing held any more (abandoned partitions aside): a stop is complete."""
        return all(s.state.phase is Phase.IDLE or s.abandoned for s in self.slots.values())

    def follow(self, state: GroupState) -> None:
        """Mirror a fresh snapshot (the watch goes on from it) and act on every partition."""
        self.mirror = GroupMirror.of(state)
        if self.parking is not None:
            self.parking.parked.reset(state.parked, state.revision)
        self.sync_all()

    def apply(self, event: WatchEvent) -> None:
        """Mirror one change and act on the partitions it concerns."""
        if event.kind == "parked" and self.parking is not None:
            record = event.value if isinstance(event.value, Parked) else None
            if record is None or written_by_holder(
                self.mirror, record, event.revision, self.spec.partitions
            ):
                self.parking.parked.apply(event.name, record, event.revision)
        for partition in sorted(self.mirror.apply(event)):
            self.sync(partition)

    def widen(self, spec: StreamSpec) -> None:
        """A resize grew the stream to ``spec``: a slot for each added partition (its
        assignment is followed as any other's). A shrink keeps every slot: the retired
        partitions are consumed as long as they are assigned, until their fence."""
        if spec.partitions <= self.spec.partitions:
            return
        added = {p: PartitionSlot(p) for p in range(self.spec.partitions, spec.partitions)}
        # replaced whole, never changed in place: other threads iterate the slots
        self.slots = {**self.slots, **added}
        self.workers = WorkerView(self.slots)
        self.spec = spec
        self.sync_all()

    def forget(self) -> None:
        """The stream is gone: so are its keys."""
        self.mirror = GroupMirror()

    def sync_all(self) -> None:
        for partition in range(self.spec.partitions):
            self.sync(partition)

    def sync(self, partition: int) -> None:
        """Feed the state machine whatever differs between it and the mirror: whether the
        partition is assigned to us first, then (after that has played out) who holds it."""
        if partition >= self.spec.partitions or self._fencing():
            return
        slot = self.slots[partition]
        owner = self.mirror.assignment.get(partition)
        assigned = slot.ours(owner, self.member, leaving=self.leaving)
        if assigned:
            if not slot.state.assigned:
                self._process(_Step(partition, Event.ASSIGNED))
        elif slot.state.phase is Phase.ACTIVE:  # moved away: yield to its heir, or drain
            self._process(
                _Step(partition, Event.YIELD if self._yields(partition) else Event.UNASSIGNED)
            )
        elif slot.state.assigned or (
            slot.state.phase is Phase.YIELDING and not self._yields(partition)
        ):  # YIELDING: its heir can no longer take it over: a drain after all
            self._process(_Step(partition, Event.UNASSIGNED))
        paused = policy.paused(self.mirror.requests, partition)
        if paused != slot.state.paused:
            self._process(_Step(partition, Event.PAUSED if paused else Event.RESUMED))
        self._sync_standby(partition)  # stood down before a freed claim is taken the usual way
        holder = self._holder(partition)
        if holder is not slot.state.holder:
            if holder is Holder.NOBODY:
                slot.freed_at = time.time()
                self._process(_Step(partition, Event.CLAIM_FREE))
            elif holder is Holder.OTHER:
                self._process(_Step(partition, Event.CLAIM_OTHER))
            else:  # our lease, not our write: the last owner handed it over
                slot.freed_at = time.time()
                self._process(_Step(partition, Event.GRANTED))
        self._sync_standby(partition)

    def _fencing(self) -> bool:
        """True when our lease is gone, asking etcd first if the session has not been
        renewed lately (the process was frozen or starved): the watch then shows our claims
        gone and our partitions reassigned before the refresher has run. Nothing is drained
        then: a cancel lets a partition's next owner, waiting at the broker, be served newer
        messages before the ones we hold unacked. The daemon's fence (``LeaseLost``, queued
        by the session) aborts the connection instead, which gives them back first."""
        session = self.session
        if session is None:
            return False
        if not session.lost.is_set() and not session.fresh():
            session.renew()
        return session.lost.is_set()

    def _yields(self, partition: int) -> bool:
        """Whether our ACTIVE, unassigned ``partition`` is left to its heir (consumed on
        until the heir, subscribed above us, takes the claim over once the broker switched
        to it; ``partq.consumers.state.priority``) instead of drained: we hand over by priority, our
        claim is unsealed, and the assignment names a live member that does too."""
        claim = self.mirror.claims.get(partition)
        owner = self.mirror.assignment.get(partition)
        heir = self.mirror.members.get(owner) if owner and owner != self.member else None
        return (
            self.priority
            and not self.leaving
            and self._holder(partition) is Holder.ME
            and claim is not None
            and not claim.sealed
            and claim.priority < priority.MAX_PRIORITY
            and heir is not None
            and heir.priority
            and not heir.leaving
            and heir.lease != 0
            and not policy.paused(self.mirror.requests, partition)
        )

    def _inherits(self, partition: int) -> bool:
        """Whether we should subscribe to ``partition`` as its heir, above its owner's
        priority: assigned to us, waiting for an unsealed claim of a live member that hands
        over by priority too (so it yields, and seals its claim before any cancel)."""
        state = self.slots[partition].state
        claim = self.mirror.claims.get(partition)
        holder = self.mirror.members.get(claim.member) if claim is not None else None
        return (
            self.priority
            and state.phase is Phase.WAITING
            and state.assigned
            and claim is not None
            and not claim.sealed
            and claim.priority < priority.MAX_PRIORITY
            and holder is not None
            and holder.priority
            and holder.lease == claim.lease
            and not policy.paused(self.mirror.requests, partition)
        )

    def _sync_standby(self, partition: int) -> None:
        """Stand by for ``partition``, or stand down, as
        :func:`partq.consumers.state.standby.wanted`
        says, or as its heir (:meth:`_inherits`), while we can (joined, not leaving).

        An heir subscription stays while the claim is the one it subscribed behind, even if
        the partition is no longer assigned to us (a leader's flapping assignment): the
        broker may have switched to it already, and the takeover is then ours to make
        (``priority.inherits_claim``); a give-back of an active consumer is not in order if a
        delivery is in flight to it when its cancel is applied. A standby behind an owner
        that no longer holds the claim (a move by priority does not activate standbys: the
        broker switches to the heir) stands down, and stands by again if still wanted."""
        slot = self.slots[partition]
        usable = not self.leaving and self.session is not None
        claim = self.mirror.claims.get(partition)
        if slot.seen and slot.state.standby is Standby.STANDING:
            if (
                usable
                and claim is not None
                and priority.inherits_claim(
                    claim, self.mirror.claim_revisions.get(partition), slot.behind, slot.seen
                )
            ):
                return
            self._process(_Step(partition, Event.STANDBY_UNWANTED))
        heir = usable and self._inherits(partition)
        want = heir or (usable and standby.wanted(self.mirror, partition, self.member, slot.state))
        if slot.state.standby is Standby.STANDING:  # a hot standby's
            # by priority only: a drain's cancel activates the standby, which gives back and
            # stands by again behind the new owner (partq.consumers.state.standby)
            moved = self.priority and claim is not None and slot.behind not in ("", claim.member)
            # given the partition of a dead owner we stand behind (a suspect): RabbitMQ
            # activates us as it notices the death, and we take over; an heir subscription
            # instead would first stand us down, giving back what we may have been sent
            kept = (
                want
                and claim is not None
                and claim.member == slot.behind
                and claim.member in policy.suspects(self.mirror.claims)
            )
            if not want or (heir and not kept) or moved:
                self._process(_Step(partition, Event.STANDBY_UNWANTED))
        if want and slot.state.standby is Standby.NONE:
            self._process(_Step(partition, Event.STANDBY_WANTED))

    def standby_lost(self, partition: int) -> None:
        """The standby's channel or connection went: stand by again if still wanted."""
        if self.slots[partition].state.standby is not Standby.NONE:
            log.info("partition %d: our standby subscription ended", partition)
        self._process(_Step(partition, Event.STANDBY_LOST))
        self._sync_standby(partition)

    def activated(self, partition: int) -> bool:
        """RabbitMQ activated our standby subscription of ``partition``: pending for
        :meth:`check_takeovers` if it still stood by (else given back at once); True if it
        is pending and no check was pending yet (queue one)."""
        first = not self._pending_takeovers()
        log.info("partition %d: RabbitMQ activated our standby subscription", partition)
        self._process(_Step(partition, Event.ACTIVATED))
        return first and self.slots[partition].state.standby is Standby.ACTIVATED

    def _pending_takeovers(self) -> list[int]:
        return [p for p, s in self.slots.items() if s.state.standby is Standby.ACTIVATED]

    def check_takeovers(self, *, allowed: bool = True) -> None:
        """Take over, or give back, every standby activated so far, after one read of the
        group: it comes after each activation, so it sees any etcd change that preceded a
        planned cancel (``partq.consumers.state.standby``). A dying owner activates all its standbys
        at once: one read for them all, not one each. Not ``allowed`` (stopping): give
        them all back. An heir's takeover needs no read: its transaction on the claim's
        revision is the whole check (``priority.inherits_claim``)."""
        pending = self._pending_takeovers()
        session = self.session if allowed else None
        state: GroupState | None = None
        if session is not None and any(not self.slots[p].seen for p in pending):
            try:
                state = self.group.snapshot()
            except EtcdUnavailable as e:
                log.warning("cannot check the takeovers of %s: %s", pending, e)
        for partition in pending:
            if self.slots[partition].seen:
                self._inherit(partition, session)
            else:
                self._take_over(partition, state, session)

    def _take_over(self, partition: int, state: GroupState | None, session: Session | None) -> None:
        behind = self.slots[partition].behind
        seen = None
        if state is not None and behind:
            seen = standby.may_take_over(state, partition, self.member, behind)
        owner = state.claims[partition].member if state is not None and seen is not None else ""
        revision = self._claim_over(partition, session, seen if owner else None, owner)
        if revision <= 0 or session is None:
            return
        log.warning(
            "partition %d: its owner %s is gone from RabbitMQ: taken over", partition, owner
        )
        metrics.TAKEOVERS.labels(*self._labels).inc()
        self.slots[partition].taken_from = owner
        claim = Claim(self.member, session.id, takeover=True, taken_from=owner, live=True)
        self.mirror.wrote_claim(partition, claim, revision)
        self._settle_takeover(partition)
        self._process(_Step(partition, Event.TAKEN_OVER))  # PROMOTE: a worker, then promote

    def _inherit(self, partition: int, session: Session | None) -> None:
        """The broker switched to our heir subscription: take the claim over if it is the
        very claim we subscribed behind (so its holder never sealed it: never cancelled, so
        it settled everything and is sent nothing more, or its connection died and what it
        held came back first), assigned to us or not; else give back. The transaction on
        the revision we subscribed behind is the check (``priority.inherits_claim`` says why)."""
        slot = self.slots[partition]
        revision = self._inherited(partition, session)
        if revision <= 0:
            self._process(_Step(partition, Event.TAKEOVER_REFUSED))
        if revision <= 0 or session is None:
            return
        log.info(
            "partition %d: RabbitMQ switched to us (priority %d): taken over from %s",
            partition,
            slot.rank,
            slot.behind,
        )
        self.mirror.wrote_claim(
            partition, Claim(self.member, session.id, priority=slot.rank, live=True), revision
        )
        self._process(_Step(partition, Event.TAKEN_OVER))
        self.sync(partition)  # taken over while the partition moved on: yield or drain it

    def _inherited(self, partition: int, session: Session | None) -> int:
        """Our heir's claim on ``partition`` over the one it subscribed behind; its revision,
        or 0. That claim's holder may have rewritten it since without sealing it (marked it
        live once subscribed, made its takeover claim ordinary): it cancelled nothing, so it
        is still the very claim (``priority.inherits_claim``), taken at its new revision. A
        refusal over such a rewrite would leave the heir given back and the owner yielding
        to it for as long as traffic flows (seen: RabbitMQ 4.0.5, a member back from a
        freeze past its lease)."""
        slot = self.slots[partition]
        seen = slot.seen
        for _ in range(_REWRITES):
            revision = self._take(partition, session, seen, rank=slot.rank)
            if revision > 0 or session is None:
                return revision
            try:
                claim, current = self.group.read_claim(partition)
            except EtcdUnavailable as e:
                log.warning("partition %d: cannot read the claim to take it over: %s", partition, e)
                return 0
            if claim is None or claim.lease != slot.behind_lease or claim.sealed:
                return 0
            if current == seen:
                return 0
            seen = current
        return 0

    def _claim_over(
        self,
        partition: int,
        session: Session | None,
        seen: int | None,
        owner: str = "",
        rank: int = 0,
    ) -> int:
        """Take the claim seen at revision ``seen`` over (None: we may not); its new
        revision, or 0 after giving the activated subscription back (TAKEOVER_REFUSED)."""
        revision = self._take(partition, session, seen, owner, rank)
        if revision <= 0:
            self._process(_Step(partition, Event.TAKEOVER_REFUSED))
        return revision

    def _take(
        self, partition: int, session: Session | None, seen: int | None, owner: str = "",
        rank: int = 0,
    ) -> int:  # fmt: skip
        """``Group.take_over`` of the claim seen at revision ``seen``; 0 if refused."""
        if seen is None or session is None:
            return 0
        try:
            return self.group.take_over(partition, self.member, session, seen, owner, priority=rank)
        except EtcdUnavailable as e:
            log.warning("partition %d: cannot take it over: %s", partition, e)
            return 0

    def settle_takeover(self, partition: int) -> None:
        """A lease TTL after a takeover: make our takeover claim ordinary, so the member we
        took it from (gone by now if it was dead) may be given partitions again."""
        claim = self.mirror.claims.get(partition)
        session = self.session
        if claim is None or not claim.takeover or session is None or claim.lease != session.id:
            return
        try:
            current, seen = self.group.read_claim(partition)
            if current is None or current.lease != session.id:
                return
            revision = self.group.take_over(partition, self.member, session, seen)
        except EtcdUnavailable as e:
            log.warning("partition %d: cannot settle the takeover yet: %s", partition, e)
            self._settle_takeover(partition)
            return
        if revision > 0:
            self.mirror.wrote_claim(partition, Claim(self.member, session.id, live=True), revision)

    def later(self, event: SettleTakeover | StopYielding) -> None:
        """A timer this asked the daemon for (``settle_takeover``, ``stop_yielding``)."""
        match event:
            case SettleTakeover(partition=partition):
                self.settle_takeover(partition)
            case StopYielding(partition=partition, since=since):
                self.stop_yielding(partition, since)

    def stop_yielding(self, partition: int, since: float) -> None:
        """``YIELD_WAIT`` after ``partition`` yielded at ``since``: drain it if its heir has
        not taken it over yet and our worker has waited for a delivery for a while. On an
        idle queue the broker switches to the heir at once but silently (no delivery comes
        to prove it), so the claim would never move. While the worker still handles what
        it was sent, wait on: the broker switches once that is settled. Sealed first, as
        every cancel."""
        slot = self.slots[partition]
        if slot.state.phase is not Phase.YIELDING or slot.yielded_at != since:
            return
        waiting = slot.worker.waiting_since if slot.worker is not None else 0.0
        if waiting is None or time.monotonic() - waiting < priority.IDLE_BEFORE_DRAIN:
            # still handling what it was sent: the broker switches once it is settled, and
            # a cancel now would activate the heir beside it (which must then give back)
            self._stop_yielding(partition, since)
            return
        log.info("partition %d: idle, and its heir has not taken it over: draining", partition)
        self._process(_Step(partition, Event.UNASSIGNED))

    def handoff(self, partition: int, event: Event) -> None:
        """An event of one partition from the broker (subscribed, drained, channel lost);
        then whatever the mirror says that its steps did not see: a drain that ends in
        WAITING, behind a claim another member took over meanwhile, subscribes as heir; one
        that ends in IDLE stands by behind the new owner if the leader names us (that
        name, and the new owner's live claim, may have come while it still drained, and
        nothing in etcd changes after them: seen in CI, a queue left with no standby)."""
        self._process(_Step(partition, event))
        if self.priority:
            self.sync(partition)
        else:
            self._sync_standby(partition)

    def release(self, partition: int) -> None:
        """Try releasing the claim again (it failed while etcd was away), unless the
        partition has moved on meanwhile (released after all, or consumed again)."""
        if self.slots[partition].state.phase in (Phase.RELEASING, Phase.HANDING):
            self._process(_Do(partition, Command.RELEASE))

    def abandon(self, partition: int) -> None:
        """Its worker failed: nothing is handled or drained there any more."""
        self.slots[partition].abandoned = True

    def drop(self) -> None:
        """Stop every partition now, without a drain: the broker requeues what was unacked,
        ahead of anything newer (``Broker.fence`` aborts the connection).

        The handler calls already under way are waited for first, up to ``fence_wait``
        seconds (none begins meanwhile, and what they finish is acked): while our
        connection lives the broker serves nobody else our partitions, so the next owner
        cannot start beside them. This is what a process frozen mid-handler (SIGSTOP, a
        long GC or VM pause) and resumed past its lease needs: its handler call finishes
        first, then the fence. A call still running after ``fence_wait`` is left running,
        and logged: the next owner may then handle beside it."""
        slots = self.slots.values()
        self._await_handlers([w for s in slots for w in (s.worker, s.retired) if w is not None])
        self.broker.fence()
        for slot in slots:
            slot.retire()
            slot.step(Event.DROPPED)
        metrics.PARTITIONS_OWNED.labels(*self._labels).set(0)
        metrics.PARTITIONS_PAUSED.labels(*self._labels).set(0)

    def _await_handlers(self, workers: list[Worker]) -> None:
        """Stop ``workers`` for a fence and wait for their handler calls under way."""
        for worker in workers:
            worker.stop(fence=True)
        deadline = time.monotonic() + self.fence_wait
        running = [
            w.partition
            for w in workers
            if not w.wait_handlers(max(0.0, deadline - time.monotonic()))
        ]
        if running:
            log.warning(
                "partitions %s: a handler call is still under way %gs after the fence began: "
                "fencing anyway; the next owner may handle beside it",
                running,
                self.fence_wait,
            )

    def resubscribe(self) -> None:
        """The broker is back: subscribe what was waiting for it."""
        for partition, slot in self.slots.items():
            if slot.state.phase is Phase.SUBSCRIBING and slot.worker is not None:
                self._subscribe(partition, slot.worker.generation)

    def _subscribe(self, partition: int, generation: int, *, adopt: bool = False) -> bool:
        """Subscribe with our claim's x-priority when handing over by priority (an heir
        then subscribes one above it), with none otherwise; ``adopt``: by making our
        standby subscription the partition's, where its priority is that one."""
        claim = self.mirror.claims.get(partition)
        if not self.priority:
            return self.broker.subscribe(partition, generation, adopt=adopt)
        rank = claim.priority if claim else 0
        return self.broker.subscribe(partition, generation, rank, adopt=adopt)

    def stop_workers(self) -> None:
        for worker in self._current_workers():
            worker.stop()

    # -- the work list -------------------------------------------------------------------

    def _process(self, first: _Step | _Do) -> None:
        """Step and carry out, in order, until nothing follows."""
        work: collections.deque[_Step | _Do] = collections.deque([first])
        while work:
            match work.popleft():
                case _Step(partition, event):
                    work.extend(self._step(partition, event))
                case _Do(partition, command):
                    work.extend(self._do(partition, command))

    def _holder(self, partition: int) -> Holder:
        claim = self.mirror.claims.get(partition)
        if claim is None:
            return Holder.NOBODY
        return Holder.ME if self.session and claim.lease == self.session.id else Holder.OTHER

    def _step(self, partition: int, event: Event) -> list[_Do]:
        before, commands = self.slots[partition].step(event)
        self._note(partition, before, self.slots[partition].state, event)
        metrics.PARTITIONS_OWNED.labels(*self._labels).set(len(self.owned()))
        paused = sum(1 for slot in self.slots.values() if slot.state.phase is Phase.PAUSED)
        metrics.PARTITIONS_PAUSED.labels(*self._labels).set(paused)
        return [_Do(partition, command) for command in commands]

    def _note(self, partition: int, before: State, after: State, event: Event) -> None:
        """Log and count a step's handoff; a channel warmed for a claim we wait for. A
        takeover is counted and logged as one (``_take_over``), not as a handoff."""
        if before.phase is not after.phase:
            log.debug(
                "partition %d: %s -> %s on %s",
                partition,
                before.phase.value,
                after.phase.value,
                event.value,
            )
        if after.phase is Phase.WAITING and before.phase is not Phase.WAITING:
            self.broker.warm(partition)  # ours once the claim goes: a channel ready for it
        if event is Event.KEPT and after.phase is Phase.ACTIVE:
            log.info("partition %d: ours again before the cancel: consuming on", partition)
        elif event is Event.TAKEN_OVER:
            pass
        elif after.phase is Phase.YIELDING and before.phase is not Phase.YIELDING:
            owner = self.mirror.assignment.get(partition)
            log.info("partition %d: moved to %s: consuming until it takes over", partition, owner)
            self.slots[partition].yielded_at = since = time.monotonic()
            self._stop_yielding(partition, since)
        elif before.phase is Phase.YIELDING and after.phase is Phase.ACTIVE:
            log.info("partition %d: ours again before its heir took it: consuming on", partition)
        elif after.phase is Phase.ACTIVE and before.phase is not Phase.ACTIVE:
            metrics.HANDOFFS.labels(*self._labels, "acquired").inc()
            log.info("partition %d: consuming", partition)
            self._mark_live(partition)
        if before.phase is Phase.DRAINING and after.phase is not Phase.DRAINING:
            metrics.HANDOFFS.labels(*self._labels, "released").inc()
            if after.phase is Phase.HANDING:
                log.info("partition %d: every delivery handled: released, cancelling", partition)
            else:
                log.info("partition %d: drained and released", partition)

    def _do(self, partition: int, command: Command) -> list[_Step]:
        """Carry out ``command``; its outcome, if the state machine needs to hear it."""
        if command in _STANDBY_COMMANDS:
            return self._do_standby(partition, command)
        if self.slots[partition].abandoned and command in (
            Command.SUBSCRIBE,
            Command.ADOPT,
            Command.CANCEL,
            Command.CUT,
            Command.RESUME,
        ):
            return []
        match command:
            case Command.SUBSCRIBE | Command.ADOPT:
                # The worker's inbox takes deliveries before its thread runs: subscribe
                # first, start the thread after (a start waits for the thread to run).
                worker = self._start_worker(partition, start=False)
                adopt = command is Command.ADOPT
                if not self._subscribe(partition, worker.generation, adopt=adopt):
                    log.info("partition %d: subscribing once RabbitMQ is back", partition)
                worker.start()
            case Command.CANCEL:
                if not self._seal(partition):
                    return []  # fenced instead: everything starts over, in order
                # another's claim (as the mirror has it now): its consumer is RabbitMQ's
                # active one (a standby took over, or the heir once the broker switched to
                # it), ours waits behind it, unless it still holds deliveries (window.Revoke)
                self.broker.cancel(partition, waiting=self._holder(partition) is Holder.OTHER)
            case Command.CUT:
                self.broker.cut(partition)
            case Command.RESUME:
                self.broker.resume(partition)
            case Command.CLAIM:
                self.broker.warm(partition)  # the channel opens while the claim is written
                return [_Step(partition, self._claim(partition))]
            case Command.RELEASE:
                return self._release(partition)
        return []

    def _mark_live(self, partition: int) -> None:
        """Our consumer of ``partition`` is subscribed: say so in our claim, so its hot
        standby stands behind it (``Group.mark_live``). Not marked (etcd unreachable), the
        partition has no standby until it is next acquired."""
        claim = self.mirror.claims.get(partition)
        session = self.session
        if claim is None or claim.live or session is None or claim.lease != session.id:
            return
        try:
            revision = self.group.mark_live(partition, session, claim)
        except EtcdUnavailable as e:
            log.warning("partition %d: cannot mark the claim live: %s", partition, e)
            return
        if revision > 0:
            self.mirror.wrote_claim(partition, replace(claim, live=True), revision)

    def _seal(self, partition: int) -> bool:
        """Before a cancel, when handing over by priority: seal our claim, so that an heir
        the cancel may activate (it waits above us at the broker) cannot take it over while
        we still handle what we hold. False if etcd cannot be reached: then we fence (the
        connection is aborted, what we held comes back first, in order) instead."""
        claim = self.mirror.claims.get(partition)
        session = self.session
        if not self.priority or claim is None or claim.sealed or session is None:
            return True
        if self._holder(partition) is not Holder.ME:
            return True  # not ours any more: nobody can take it over from us
        try:
            revision = self.group.seal(partition, session, claim)
        except EtcdUnavailable as e:
            log.warning(
                "partition %d: cannot seal the claim before a drain (%s): fencing", partition, e
            )
            self.drop()
            self._resync()
            return False
        if revision > 0:
            self.mirror.wrote_claim(partition, replace(claim, sealed=True), revision)
        return True

    def _do_standby(self, partition: int, command: Command) -> list[_Step]:
        """Carry out a command of the hot standby's phases (``partq.consumers.state.handoff``), an
        heir's included (a standby subscribed above the owner:
        ``partq.consumers.state.priority``)."""
        match command:
            case Command.STAND_BY:
                slot = self.slots[partition]
                claim = self.mirror.claims.get(partition)
                heir = claim is not None and self._inherits(partition)
                rank = priority.heir_priority(claim.priority) if heir and claim else None
                if not self.broker.stand_by(partition, rank):
                    return [_Step(partition, Event.STANDBY_LOST)]  # no connection: not standing
                slot.behind = claim.member if claim is not None else ""
                if heir and rank is not None and claim is not None:
                    slot.seen = self.mirror.claim_revisions.get(partition, 0)
                    slot.rank, slot.behind_lease = rank, claim.lease
                    log.info(
                        "partition %d: subscribed above %s (priority %d): its heir",
                        partition,
                        slot.behind,
                        rank,
                    )
                    return []
                owner = self.mirror.assignment.get(partition)
                log.info("partition %d: standing by behind %s", partition, owner)
            case Command.STAND_DOWN:
                self.broker.stand_down(partition)
            case Command.GIVE_BACK:
                # an activation we may not take over (refused, stood down, or the
                # partition ours on another subscription): not always a planned move's
                log.info(
                    "partition %d: giving our activated standby subscription back, in order",
                    partition,
                )
                self.broker.give_back(partition)
            case Command.PROMOTE:  # the worker first: the standby's deliveries go to it
                worker = self._start_worker(partition)
                self.broker.promote(partition, worker.generation)
        return []

    def _start_worker(self, partition: int, *, start: bool = True) -> Worker:
        slot = self.slots[partition]
        old = slot.predecessor()
        make: Callable[..., Worker] = (
            Worker if self.pool is None else functools.partial(KeyedWorker, pool=self.pool)
        )
        worker = make(
            spec=self.spec,
            partition=partition,
            member=self.member,
            handler=self.handler,
            broker=self.broker,
            session=self.session,
            dead_letters=self.dead_letters,
            max_attempts=self.max_attempts,
            retry_backoff=self.retry_backoff,
            previous=old,
            freed_at=slot.take_freed_at(),
            handler_timeout=self.handler_timeout,
            on_failure=self._on_worker_failure,
            parking=self.parking,
            loop=self.loop,
            generation=next(self._generations),
            resize=self.resize,
            # our claim's revision now: any later owner's is greater (Message.fencing_token)
            fencing_token=self.mirror.claim_revisions.get(partition, 0),
        )
        slot.worker = worker
        if start:
            worker.start()
        return worker

    def _claim(self, partition: int) -> Event:
        session = self.session
        assert session is not None
        try:
            revision = self.group.claim(partition, self.member, session)
        except EtcdUnavailable as e:
            log.warning("partition %d: cannot claim: %s", partition, e)
            self._resync()
            return Event.CLAIM_REFUSED
        if revision <= 0:
            return Event.CLAIM_REFUSED
        # mirror our own write now: the watch echoes it later
        self.mirror.wrote_claim(partition, Claim(self.member, session.id), revision)
        return Event.CLAIMED

    def _release(self, partition: int) -> list[_Step]:
        self.slots[partition].retire()
        session = self.session
        assert session is not None
        heir = self._heir(partition)
        try:
            handed = self._hand_over(partition, session, heir) if heir else 0
            revision = handed or self.group.release(partition, session)
        except EtcdUnavailable as e:
            log.warning("partition %d: cannot release the claim yet: %s", partition, e)
            self._retry_release(partition)
            return []
        if handed and heir:  # mirror our own write now, as for a claim
            self.mirror.wrote_claim(partition, Claim(heir.id, heir.lease), revision)
            log.debug("partition %d: claim handed over to %s", partition, heir.id)
            return [_Step(partition, Event.RELEASED), _Step(partition, Event.CLAIM_OTHER)]
        if revision > 0:
            self.mirror.wrote_claim(partition, None, revision)
        return [_Step(partition, Event.RELEASED)]

    def _hand_over(self, partition: int, session: Session, heir: Member) -> int:
        """Hand the claim to ``heir``, or 0 if our etcd role may not put on its lease (etcd
        3.4 does not check a transaction's lease puts; a version that did would refuse it
        to a ``--member`` role every time): then we release it instead."""
        try:
            return self.group.hand_over(partition, session, heir)
        except EtcdPermissionDenied as e:
            log.warning("partition %d: cannot hand the claim to %s: %s", partition, heir.id, e)
            return 0

    def _heir(self, partition: int) -> Member | None:
        """The live member the partition is assigned to, if not us: our claim goes straight
        to it (``Group.hand_over``), so it need not claim once the claim is free.

        None while the partition has a hot standby: a standby reads a live owner's claim
        when RabbitMQ activates it as a dying owner's, and the heir's claim would be there
        the moment our cancel could activate it; a deleted claim tells it to give back."""
        if self.mirror.standbys.get(partition):
            return None
        owner = self.mirror.assignment.get(partition)
        member = self.mirror.members.get(owner) if owner and owner != self.member else None
        if member is None or member.leaving or member.lease == 0:
            return None
        return member

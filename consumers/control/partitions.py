"""The partitions of one consumer: the group mirror, and one slot per partition.

:class:`Partitions` belongs to the daemon's controller thread (``partq.consumers.control.daemon``),
which hands it watch events and the broker's events. It keeps the stream's group keys in
a :class:`partq.coordinator.store.mirror.GroupMirror` and each partition's state machine
(:func:`partq.consumers.state.handoff.step`) in step with it, and carries out the machines'
commands: subscribe and cancel at the broker, start and stop the partition's worker here;
claim and release in etcd through :class:`partq.consumers.control.claims.Claims`; stand
by, take over or give back as its hot standby or heir through
:class:`partq.consumers.control.takeovers.Standbys`; yield to an heir through
:class:`partq.consumers.control.yielding.Yielding`; workers are made by
:class:`partq.consumers.control.crew.Crew`.

Without recursion, as a work list: stepping a partition yields commands, running a
command may yield a follow-up event (its outcome: claimed, refused, released), and
each is processed in turn until nothing follows.

Everything about one partition is one :class:`partq.consumers.control.slot.PartitionSlot`,
kept in one mapping, replaced whole when a resize adds partitions (``slots``); a slot
changes only by a step of its state machine (the hot standby's phases included) or one of
its own methods, never by a write from here.

Threads. Every method runs on the controller thread, which owns the mirror, the slots,
and ``claims``, ``standbys``, ``yielding``, ``crew``. Other threads only read: the pika
I/O thread looks a worker up (``workers.get``, in ``Consumer._route``: one dict lookup
and one attribute read); the HTTP server thread's Prometheus scrape calls
:meth:`in_flight` and ``_longest_wait``, which read each slot's ``worker`` once and then
its ``busy`` / ``longest_wait``, or the pool's ``busy``. The broker is driven only
through its thread-safe methods, and a worker, once started here, reaches the controller
only through ``on_worker_failure`` (a queued event).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from partq.consumers import metrics
from partq.consumers.broker.port import BrokerPort
from partq.consumers.control.claims import Claims
from partq.consumers.control.crew import Crew
from partq.consumers.control.events import SettleTakeover, StopYielding
from partq.consumers.control.slot import PartitionSlot, WorkerView
from partq.consumers.control.takeovers import Standbys
from partq.consumers.control.yielding import Yielding
from partq.consumers.handling.parkedkeys import disowned, written_by_holder
from partq.consumers.handling.parking import Parking
from partq.consumers.handling.worker import Worker
from partq.consumers.state.handoff import Command, Event, Holder, Phase, State
from partq.coordinator.leader import policy
from partq.coordinator.store.group import Group, GroupState, Parked, WatchEvent
from partq.coordinator.store.mirror import GroupMirror
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec

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
# Commands not carried out for an abandoned partition (its worker failed)
_CONSUMING_COMMANDS = frozenset(
    {Command.SUBSCRIBE, Command.ADOPT, Command.CANCEL, Command.CUT, Command.RESUME}
)


class Partitions:
    """Every partition of the stream, from this member's side (the module docstring)."""

    def __init__(
        self,
        *,
        spec: StreamSpec,
        member: str,
        group: Group,
        broker: BrokerPort,
        crew: Crew,
        retry_release: Callable[[int], None],
        resync: Callable[[], None],
        settle_takeover: Callable[[int], None] = lambda _p: None,
        stop_yielding: Callable[[int, float], None] = lambda _p, _since: None,
        parking: Parking | None = None,
    ) -> None:
        """``crew`` makes the workers (one message at a time per partition, or messages of
        different keys at once on one pool: :class:`Crew`); the callables ask the daemon
        for deadlines: ``retry_release(p)`` and ``resync()`` after a backoff delay,
        ``settle_takeover(p)`` a lease TTL later, ``stop_yielding(p, since)``
        ``YIELD_WAIT`` later."""
        self.spec = spec
        self.member = member
        self.group = group
        self.broker = broker
        self.crew = crew
        self.parking = parking  # None: the stream dead-letters instead of parking keys
        self._resync = resync
        self.session: Session | None = None  # the member's current session (None: none)
        # planned handoffs by consumer priority (partq.consumers.state.priority): the setting
        # allows it and the broker switches; set by the daemon on each connection, before joining
        self.priority = False
        self.leaving = False  # the member is stopping: nothing counts as assigned to it
        self.mirror = GroupMirror()
        self.slots = {p: PartitionSlot(p) for p in range(spec.partitions)}
        self.workers: Mapping[int, Worker] = WorkerView(self.slots)
        self.labels = (spec.scope, member)
        self.claims = Claims(self, retry_release, resync)
        self.standbys = Standbys(self, settle_takeover)
        self.yielding = Yielding(self, stop_yielding)
        metrics.CONCURRENCY.labels(*self.labels).set(crew.concurrency)
        metrics.IN_FLIGHT_MEMBER.labels(*self.labels).set_function(self.in_flight)
        metrics.KEY_WAIT_SECONDS.labels(*self.labels).set_function(self._longest_wait)

    def in_flight(self) -> int:
        """Messages of this member in a handler now (one per busy worker without a pool)."""
        return self.crew.in_flight(self._current_workers())

    def _longest_wait(self) -> float:
        return self.crew.longest_wait(self._current_workers())

    def _current_workers(self) -> list[Worker]:
        """Each slot's worker, read once (also from the HTTP server thread)."""
        return [w for w in (slot.worker for slot in self.slots.values()) if w is not None]

    def close(self) -> None:
        """The member is done: end the handler pool's threads and the event loop."""
        self.crew.close()

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
        if event.kind == "claim" and self.claims.disowned(event):
            return  # on our lease in our name, but not ours: deleted, never granted to us
        if event.kind == "parked" and self.parking is not None:
            record = event.value if isinstance(event.value, Parked) else None
            holds = record is not None and self.claims.holder(record.partition) is Holder.ME
            if record is not None and disowned(
                self.group, self.parking.parked, self.member, holds, record, event.revision
            ):
                return
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
                _Step(
                    partition, Event.YIELD if self.yielding.yields(partition) else Event.UNASSIGNED
                )
            )
        elif slot.state.assigned or (
            slot.state.phase is Phase.YIELDING and not self.yielding.yields(partition)
        ):  # YIELDING: its heir can no longer take it over: a drain after all
            self._process(_Step(partition, Event.UNASSIGNED))
        paused = policy.paused(self.mirror.requests, partition)
        if paused != slot.state.paused:
            self._process(_Step(partition, Event.PAUSED if paused else Event.RESUMED))
        self.standbys.sync(partition)  # stood down before a freed claim is taken the usual way
        holder = self.claims.holder(partition)
        if holder is not slot.state.holder:
            if holder is Holder.NOBODY:  # the slot notes when (the next worker's handoff gap)
                self._process(_Step(partition, Event.CLAIM_FREE))
            elif holder is Holder.OTHER:
                self._process(_Step(partition, Event.CLAIM_OTHER))
            else:  # our lease, not our write: the last owner handed it over
                self._process(_Step(partition, Event.GRANTED))
        self.standbys.sync(partition)

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

    # -- deadlines it asked the daemon for -----------------------------------------------

    def later(self, event: SettleTakeover | StopYielding) -> None:
        """A deadline this asked the daemon for (``settle_takeover``, ``stop_yielding``)."""
        match event:
            case SettleTakeover(partition=partition):
                self.standbys.settle(partition)
            case StopYielding(partition=partition, since=since):
                self.yielding.stop(partition, since)

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
            self.standbys.sync(partition)

    def release(self, partition: int) -> None:
        """Try releasing the claim again (it failed while etcd was away), unless the
        partition has moved on meanwhile (released after all, or consumed again)."""
        if self.slots[partition].state.phase in (Phase.RELEASING, Phase.HANDING):
            self._process(_Do(partition, Command.RELEASE))

    def abandon(self, partition: int) -> None:
        """Its worker failed: nothing is handled or drained there any more."""
        self.slots[partition].abandon()

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
        self.crew.await_handlers([w for s in slots for w in (s.worker, s.retired) if w is not None])
        self.broker.fence()
        for slot in slots:
            slot.drop()
        metrics.PARTITIONS_OWNED.labels(*self.labels).set(0)
        metrics.PARTITIONS_PAUSED.labels(*self.labels).set(0)

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

    def hire(self, partition: int, *, start: bool = True) -> Worker:
        """The partition's next worker (:meth:`Crew.hire`), fenced by our claim's revision
        now: any later owner's is greater (``Message.fencing_token``)."""
        token = self.mirror.claim_revisions.get(partition, 0)
        return self.crew.hire(self.slots[partition], self.spec, self.session, token, start=start)

    # -- the work list -------------------------------------------------------------------

    def feed(self, partition: int, event: Event) -> None:
        """Step ``partition``'s state machine with ``event`` and carry out what follows."""
        self._process(_Step(partition, event))

    def _process(self, first: _Step | _Do) -> None:
        """Step and carry out, in order, until nothing follows."""
        work: collections.deque[_Step | _Do] = collections.deque([first])
        while work:
            match work.popleft():
                case _Step(partition, event):
                    work.extend(self._step(partition, event))
                case _Do(partition, command):
                    work.extend(self._do(partition, command))

    def _step(self, partition: int, event: Event) -> list[_Do]:
        before, commands = self.slots[partition].step(event)
        self._note(partition, before, self.slots[partition].state, event)
        metrics.PARTITIONS_OWNED.labels(*self.labels).set(len(self.owned()))
        paused = sum(1 for slot in self.slots.values() if slot.state.phase is Phase.PAUSED)
        metrics.PARTITIONS_PAUSED.labels(*self.labels).set(paused)
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
            self.yielding.began(partition)
        elif before.phase is Phase.YIELDING and after.phase is Phase.ACTIVE:
            log.info("partition %d: ours again before its heir took it: consuming on", partition)
        elif after.phase is Phase.ACTIVE and before.phase is not Phase.ACTIVE:
            metrics.HANDOFFS.labels(*self.labels, "acquired").inc()
            log.info("partition %d: consuming", partition)
            self.claims.mark_live(partition)
        if before.phase is Phase.DRAINING and after.phase is not Phase.DRAINING:
            metrics.HANDOFFS.labels(*self.labels, "released").inc()
            if after.phase is Phase.HANDING:
                log.info("partition %d: every delivery handled: released, cancelling", partition)
            else:
                log.info("partition %d: drained and released", partition)

    def _do(self, partition: int, command: Command) -> list[_Step]:
        """Carry out ``command``; its outcome, if the state machine needs to hear it."""
        if command in _STANDBY_COMMANDS:
            return [_Step(partition, e) for e in self.standbys.do(partition, command)]
        if self.slots[partition].abandoned and command in _CONSUMING_COMMANDS:
            return []
        match command:
            case Command.SUBSCRIBE | Command.ADOPT:
                # The worker's inbox takes deliveries before its thread runs: subscribe
                # first, start the thread after (a start waits for the thread to run).
                worker = self.hire(partition, start=False)
                adopt = command is Command.ADOPT
                if not self._subscribe(partition, worker.generation, adopt=adopt):
                    log.info("partition %d: subscribing once RabbitMQ is back", partition)
                worker.start()
            case Command.CANCEL:
                if not self.claims.seal(partition):
                    return []  # fenced instead: everything starts over, in order
                # another's claim (as the mirror has it now): its consumer is RabbitMQ's
                # active one (a standby took over, or the heir once the broker switched to
                # it), ours waits behind it, unless it still holds deliveries (window.Revoke)
                self.broker.cancel(partition, waiting=self.claims.holder(partition) is Holder.OTHER)
            case Command.CUT:
                self.broker.cut(partition)
            case Command.RESUME:
                self.broker.resume(partition)
            case Command.CLAIM:
                self.broker.warm(partition)  # the channel opens while the claim is written
                return [_Step(partition, self.claims.claim(partition))]
            case Command.RELEASE:
                return [_Step(partition, e) for e in self.claims.release(partition)]
        return []

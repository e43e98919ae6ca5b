"""The coordinator service: one leader per stream keeps the assignment balanced.

The I/O shell around pure parts. Per stream, a :class:`StreamCoordinator` thread
runs campaigns; each one is a session (lease), a candidate in the stream's
election (:mod:`partq.coordinator.store.election`), one snapshot and one watch of the group
keys (no polling). Then it loops: an event (a watch event, the settle timer, the
lease lost, a stop: :mod:`partq.coordinator.store.events`) goes into the mirror
(:class:`partq.coordinator.store.mirror.GroupMirror`); whoever leads asks the rules
(:mod:`partq.coordinator.leader.policy`) what to do and writes the assignment, one key per
changed partition, in transactions fenced on its candidate key
(:meth:`partq.coordinator.store.election.Fence.compare`); metrics are exported last.

With ``balance = "load"`` a timer (:class:`partq.coordinator.store.events.LoadTick`, every
``load_interval`` seconds) makes the leader measure each partition's load (the members'
load reports, :meth:`partq.coordinator.store.group.Group.loads`, and the queue depths) and plan by
it,
moving at most ``load_moves`` partitions a tick; between ticks plans use the last loads,
and move nothing by load unless the member set changed.

Values come decoded from :class:`partq.coordinator.store.group.Group`; a malformed one is an
absent key (so a garbled assignment is rewritten, a garbled request ignored). A
stream deleted, or whose spec is malformed, makes the coordinator not ready
(:meth:`StreamCoordinator.check`) until it is back; then it campaigns again.

Threads. Each :class:`StreamCoordinator` is one thread (``coordinator-<stream>``) that
alone reads and writes its mirror, spec, loads, timers and the gauges it exports. Others
reach it only through ``events`` (a ``queue.Queue``): the etcd watch stream's thread
(``_watched``: ``WatchEvent``, ``WatchFailed``), the session's keepalive thread
(``LeaseLost``) and :meth:`StreamCoordinator.stop` (``Stop``, with the ``stopping``
event). ``partq coordinator``'s main and HTTP server threads read ``leading`` (a
``threading.Event``), ``spec``, ``missing`` and ``failure`` (single references to values
never changed in place) and ``history`` (locked inside ``History``). ``depths`` is
called on this thread: the CLI's ``QueueDepths`` is shared with the HTTP thread, under
its own lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from partq.coordinator import metrics
from partq.coordinator.leader import forged, loads, policy, resize
from partq.coordinator.ops.history import History
from partq.coordinator.store.codec import Member
from partq.coordinator.store.election import Election, Fence
from partq.coordinator.store.events import LeaseLost, LoadTick, Settled, Stop, WatchFailed
from partq.coordinator.store.group import Group, WatchEvent
from partq.coordinator.store.mirror import GroupMirror
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry

from partq.kernel import logs
from partq.kernel.backoff import Backoff
from partq.kernel.errors import (
    EtcdCompacted,
    EtcdError,
    EtcdPermissionDenied,
    EtcdUnavailable,
    MalformedValue,
    NotLeader,
    PartqError,
    StreamNotFound,
    UsageError,
    retryable,
)

__all__ = ["CoordinatorConfig", "CoordinatorEvent", "StreamCoordinator"]

log = logging.getLogger("partq.coordinator")
_EXPORT_EVERY = 1.0  # seconds: the gauges' refresh while watch events keep coming
_BATCH = 10_000  # watch events mirrored before one plan, at most
_BACKOFF = Backoff()  # between campaigns: 0.2 s doubling to 5 s, reset once one got going

CoordinatorEvent = WatchEvent | WatchFailed | LeaseLost | Settled | Stop | LoadTick
Depths = Callable[[StreamSpec], Mapping[int, int]]  # ready messages per partition queue


@dataclass(frozen=True)
class CoordinatorConfig:
    min_members: int = 1
    settle: float = 1.0
    max_moves: int | None = None
    manual: bool = False
    ttl: int = 5
    # Name a hot standby per partition (consumers subscribe as such): "on", "off", or
    # "auto", on quorum queues and not on classic ones (policy.standbys)
    standby: policy.Standbys = "auto"
    balance: Literal["count", "load"] = "count"  # what plans even out (the module docstring)
    load_interval: float = 10.0  # seconds between load measurements (balance = "load")
    load_moves: int = 2  # partitions moved from a live owner per load tick, at most
    # seconds a claim on a lease no live member holds is honoured (partq.coordinator.leader.forged)
    unbound_grace: float = 60.0
    horizon: float = 60.0  # a backlog counts as load spread over this many seconds

    def __post_init__(self) -> None:
        if self.standby not in get_args(policy.Standbys):
            raise ValueError(f"standby must be auto, on or off, not {self.standby!r}")
        if self.balance not in ("count", "load"):
            raise ValueError(f"balance must be count or load, not {self.balance!r}")
        if not self.load_interval > 0:
            raise ValueError(f"load interval must be above 0 s, got {self.load_interval}")
        if self.load_moves < 1:
            raise ValueError(f"load moves must be at least 1, got {self.load_moves}")


class _Missing(Exception):
    """The stream's spec is gone or unreadable: not ready until it is back."""


def _spec_changed(old: StreamSpec | None, new: StreamSpec) -> str:
    """What changed of a stream's spec, for people: ``its spec changed: partitions 12 -> 24,
    epoch 0 -> 1`` (the log line names the stream; the version follows the epoch)."""
    if old is None:
        return f"its spec changed to {new.partitions} partitions"
    changes = [
        f"{f.name} {getattr(old, f.name)} -> {getattr(new, f.name)}"
        for f in dataclasses.fields(new)
        if f.name != "version" and getattr(old, f.name) != getattr(new, f.name)
    ]
    return "its spec changed: " + (", ".join(changes) or "rewritten")


class StreamCoordinator(threading.Thread):
    """Campaigns for, and while leading coordinates, one stream, until :meth:`stop`.

    Each campaign is one session, one candidate key, one snapshot and one watch. A
    campaign ends on an error and the next one starts after a backoff (0.2 s doubling
    to 5 s, reset once a campaign got going): etcd away, deposed, or a changed spec
    (logged at warning); the stream missing (deleted, or its spec malformed: logged
    once, :meth:`check` fails until it is back); anything unexpected (logged with its
    traceback, counted in ``partq_coordinator_failures_total``). A partq error that is
    not retryable (:func:`partq.kernel.errors.retryable`: etcd refused our user, certificate or
    role) ends the thread, as does an error in that retry loop itself: :attr:`failure`
    holds it, and ``partq coordinator`` exits 1.
    """

    def __init__(
        self,
        registry: Registry,
        stream: str,
        config: CoordinatorConfig,
        *,
        depths: Depths | None = None,
    ) -> None:
        """``depths``: the partition queues' depths (for ``balance = "load"``; without it,
        loads are what the members report handling)."""
        super().__init__(name=f"coordinator-{stream}", daemon=True)
        self.registry = registry
        self.stream = stream
        self.config = config
        self.group = Group(registry.client, registry.where, stream)
        self.election = Election(self.group)
        self.events: queue.Queue[CoordinatorEvent] = queue.Queue()
        self.stopping = threading.Event()
        self.leading = threading.Event()
        self.spec: StreamSpec | None = None
        self.missing: str | None = None  # why the stream is missing, while it is
        self.failure: BaseException | None = None  # what ended the thread, if anything did
        self.mirror = GroupMirror()
        self._watch_id: int | None = None  # this campaign's watch of the group keys
        self._unverified: dict[str, int] = {}  # parked records to check: key id -> revision
        self._unbound: dict[int, tuple[int, float]] = {}  # partition -> (revision, deadline)
        self._forged_candidates: dict[str, int] = {}  # leader keys not on their lease -> rev
        self._named: dict[int, str] = {}  # the standby keys we wrote while leading
        self._refusals = forged.Refusals()  # forged keys etcd would not let us delete
        self.history = History()  # for the status page: rebalances, handoffs, depth rates
        self._settle_at: float | None = None
        self._assigned_once = False
        self._going = False  # this campaign reached its event loop
        self._policy_refused = False  # etcd refused our policy key (logged once)
        self._last_error: str | None = None
        self._exported: set[tuple[str, str, str, str]] = set()  # our partq_assignment_info
        self._exported_at = 0.0
        self._depths = depths
        # balance = "load": each partition's load (None: balance by count), when it is next
        # measured, the depths measured last (when, what), the member set planned for last
        self.loads: dict[int, float] | None = {} if config.balance == "load" else None
        self._load_at: float | None = None
        self._depth_sample: tuple[float, dict[int, int]] | None = None
        self._planned_members: frozenset[str] | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        self.stopping.set()
        self.events.put(Stop())

    def check(self) -> None:
        """Raise (a :class:`PartqError` saying why) unless this stream can be coordinated."""
        if self.failure is not None:
            raise PartqError(f"the coordinator of {self.stream} died: {self.failure!r}")
        if self.missing is not None:
            raise StreamNotFound(f"stream {self.stream} is missing: {self.missing}")

    def run(self) -> None:
        with logs.bind(stream=self.stream):
            try:
                self._run()
            except PartqError as e:  # refused: its line says what to fix; exits 1
                self.failure = e
                log.critical("%s: the coordinator stopped: %s", self.stream, e)
            except BaseException as e:  # partq coordinator exits 1 on it
                self.failure = e
                log.critical("%s: the coordinator thread died: %r", self.stream, e, exc_info=True)
            finally:
                self._step_down()

    def _run(self) -> None:
        delays = _BACKOFF.delays()
        while not self.stopping.is_set():
            self._going = False
            error: Exception | None = None
            try:
                self._campaign()
            except Exception as e:
                error = e
            self._step_down()
            if isinstance(error, PartqError) and not retryable(error):
                raise error
            if self._going:
                delays.reset()
            wait = delays.next()
            if error is not None:
                self._ended(error, wait)
            if self.stopping.wait(wait):
                break

    def _ended(self, error: Exception, wait: float) -> None:
        """Log (and count) why a campaign ended; the next one starts in ``wait`` seconds."""
        match error:
            case PartqError():  # retryable: etcd away, or deposed
                log.warning("%s: %s; campaigning again in %.1fs", self.stream, error, wait)
            case _Missing():
                if self.missing != str(error):
                    log.warning(
                        "%s: the stream is missing (deleted, or its spec is unreadable): %s; "
                        "not ready, waiting for it",
                        self.stream,
                        error,
                    )
                self.missing = str(error)
            case _:
                metrics.FAILURES.labels(self.stream, type(error).__name__).inc()
                text = f"{type(error).__name__}: {error}"
                if text != self._last_error:
                    log.error(
                        "%s: unexpected error; campaigning again in %.1fs",
                        self.stream,
                        wait,
                        exc_info=error,
                    )
                else:
                    log.warning("%s: again %s; retrying in %.1fs", self.stream, text, wait)
                self._last_error = text

    def _campaign(self) -> None:
        try:
            self.spec = self.registry.read_spec(self.stream)
        except (StreamNotFound, MalformedValue, UsageError) as e:
            raise _Missing(str(e)) from None
        if self.missing is not None:
            log.info("%s: the stream is back; campaigning", self.stream)
            self.missing = None
        self._drain_events()  # what the previous campaign's watch left is stale
        session = Session(
            self.registry.client,
            self.registry.where,
            self.config.ttl,
            on_lost=lambda: self.events.put(LeaseLost()),
        )
        try:
            fence = self.election.campaign(session)
            self._announce_policy(session)
            self._follow(fence)
            self._settle_at = time.monotonic() + self.config.settle
            if self.loads is not None:
                self._load_at = time.monotonic() + self.config.load_interval
            self._going = True
            self._last_error = None
            self._loop()
        finally:
            self._step_down()
            if self._watch_id is not None:
                self.group.cancel_watch(self._watch_id)
                self._watch_id = None
            session.close(revoke=True)  # our candidate key goes with the lease

    def _follow(self, fence: Fence) -> None:
        """Read the group keys into the mirror, and watch them from there."""
        state = self.group.snapshot()
        if state.spec is None:  # deleted (or garbled) since we read it
            raise _Missing(f"stream {self.stream!r} was deleted")
        if state.spec != self.spec:
            raise NotLeader(_spec_changed(self.spec, state.spec))
        self.mirror = GroupMirror.of(state)
        self._forged_candidates = {
            m.key.rsplit("/", 1)[1]: m.revision
            for m in state.malformed.values()
            if m.kind == "leader"
        }
        self.history.seed({p: c.member for p, c in state.claims.items()})
        if self.mirror.candidates.get(fence.name) != fence.revision:
            raise NotLeader(f"our candidate key {fence.key} is gone")
        self._watch_id = self.group.watch(state.revision, self._watched)

    def _resync(self, why: EtcdCompacted) -> None:
        """The watch fell behind etcd's compaction: read the group afresh and watch on from
        there, in the same campaign. Every change the old watch brought is already taken
        (it ended after them), so none is applied over the new read."""
        log.warning("%s: %s; reading the group keys again", self.stream, why)
        fence = self.election.fence
        assert fence is not None
        if self._watch_id is not None:
            self.group.cancel_watch(self._watch_id)
            self._watch_id = None
        self._follow(fence)
        if self.leading.is_set():  # records parked while unwatched are judged too
            self._unverified = dict(self.mirror.parked_revisions)

    def _watched(self, change: WatchEvent | Exception) -> None:
        self.events.put(WatchFailed(change) if isinstance(change, Exception) else change)

    def _drain_events(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self.events.get_nowait()  # a Stop among them: self.stopping is set

    def _step_down(self) -> None:
        if self.leading.is_set():
            log.info("%s: no longer leading", self.stream)
        self.leading.clear()
        self._unbound.clear()  # its deadlines would wake a follower for nothing
        self._refusals.clear()
        self._named.clear()
        metrics.IS_LEADER.labels(self.stream).set(0)
        self._export_assignment(set())

    # -- the event loop ------------------------------------------------------------------

    def _next(self) -> CoordinatorEvent:
        """The next event; a due load measurement first (a busy watch must not starve it),
        :class:`Settled` when the settle timer runs out with nothing else to do."""
        for _ in range(2):
            now = time.monotonic()
            if self._load_at is not None and now >= self._load_at:
                self._load_at = now + self.config.load_interval
                return LoadTick()
            unbound = min((d for _, d in self._unbound.values()), default=None)
            timers = [t for t in (self._settle_at, self._load_at, unbound) if t is not None]
            timeout = max(0.0, min(timers) - now) if timers else None
            try:
                return self.events.get(timeout=timeout)
            except queue.Empty:
                if self._settle_at is not None and time.monotonic() >= self._settle_at:
                    return Settled()
        return Settled()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            # Every event already queued is mirrored before one plan: planning is O(P), and
            # a rebalance's own writes come back as a burst of watch events (P of them after
            # a first assignment): one plan per event would be O(P²).
            batch = [self._next(), *self._ready(_BATCH)]
            lead: CoordinatorEvent = batch[-1]
            for event in batch:
                if isinstance(event, Stop):
                    return
                lead = self._take(event, lead)
            self._update_leadership()
            if self.leading.is_set():
                self._lead(lead)
            # The gauges cost O(P) too: once per batch, and at least every second.
            now = time.monotonic()
            if self.events.empty() or now - self._exported_at >= _EXPORT_EVERY:
                self._export()
                self._exported_at = now

    def _take(self, event: CoordinatorEvent, lead: CoordinatorEvent) -> CoordinatorEvent:
        """Mirror one event (or raise what ends the campaign); the event the next step
        leads with."""
        match event:
            case LeaseLost():
                raise EtcdUnavailable("our lease is lost")
            case WatchFailed(error=EtcdCompacted() as error):
                self._resync(error)
            case WatchFailed(error=PartqError() as error):
                raise error
            case WatchFailed(error=error):
                raise EtcdUnavailable(str(error))
            case WatchEvent():
                self._apply(event)
                if event.kind == "claim" and not isinstance(lead, LoadTick):
                    return event  # a new owner took a partition: the next step
            case LoadTick():
                return event  # measure and plan by load, whatever else came
        return lead

    def _ready(self, limit: int) -> list[CoordinatorEvent]:
        """The events already queued (at most ``limit``), without waiting."""
        found: list[CoordinatorEvent] = []
        with contextlib.suppress(queue.Empty):
            while len(found) < limit:
                found.append(self.events.get_nowait())
        return found

    def _apply(self, event: WatchEvent) -> None:
        """Mirror one change, and react to what is about the campaign itself."""
        self.mirror.apply(event)
        # the leader checks who wrote a parked record (partq.coordinator.leader.forged); a
        # follower's list would be replaced when it comes to lead (_update_leadership)
        if event.kind == "parked" and self.leading.is_set():
            if event.value is None:
                self._unverified.pop(event.name, None)
            else:
                self._unverified[event.name] = event.revision
        if event.kind == "claim":
            self.history.claim(event.partition, self.mirror.claims.get(event.partition))
        if event.kind == "leader":  # one not on its lease never leads; the leader deletes it
            if event.malformed is not None:
                self._forged_candidates[event.name] = event.revision
            else:
                self._forged_candidates.pop(event.name, None)
        fence = self.election.fence
        match event:
            case WatchEvent(kind="member", value=Member(leaving=True)):
                self._settle_at = time.monotonic()  # a planned stop: hand its partitions on now
            case WatchEvent(kind="member"):
                self._settle_at = time.monotonic() + self.config.settle
            case WatchEvent(kind="leader", value=None) if fence and event.name == fence.name:
                raise NotLeader(f"our candidate key {fence.key} is gone")
            case WatchEvent(kind="spec", value=StreamSpec() as spec) if spec != self.spec:
                raise NotLeader(_spec_changed(self.spec, spec))
            case WatchEvent(kind="spec", value=None, malformed=malformed):
                why = f"its spec is malformed: {malformed}" if malformed else ""
                raise _Missing(why or f"stream {self.stream!r} was deleted")

    def _announce_policy(self, session: Session) -> None:
        """Show our settings beside our candidacy: `partq rebalance` warns when the
        coordinators of a stream differ (a failover would change how it is balanced).
        Optional: a role without the right to the policy key still coordinates."""
        try:
            self.group.announce_policy(session, dataclasses.asdict(self.config))
        except EtcdPermissionDenied as e:
            if not self._policy_refused:
                log.warning("%s: not announcing this coordinator's policy: %s", self.stream, e)
            self._policy_refused = True

    def _update_leadership(self) -> None:
        self._forged_candidates.update(self.mirror.foreign_candidates)  # the leader deletes
        leading = self.election.is_leader({name: r for r, name in self.mirror.leaders})
        if leading and not self.leading.is_set():
            assert self.election.fence is not None
            log.info("%s: leading (candidate %s)", self.stream, self.election.fence.key)
            self.leading.set()
            self._unverified = dict(self.mirror.parked_revisions)
            self._settle_at = time.monotonic() + self.config.settle
        elif not leading and self.leading.is_set():
            self._step_down()
        metrics.IS_LEADER.labels(self.stream).set(1 if leading else 0)

    def _served(self) -> StreamSpec:
        """The spec as far as assigning goes: during a shrink, with the retired partitions
        still draining (:func:`partq.coordinator.leader.resize.served`)."""
        assert self.spec is not None
        record = self.mirror.resize
        drained = (  # believed only with their fence's seal (resize.State.sealed_by)
            (d.epoch, d.partition)
            for d in self.mirror.drained.values()
            if record is None or record.sealed_by(d.partition, d.seal)
        )
        count = resize.served(self.spec.partitions, record, drained)
        if count == self.spec.partitions:
            return self.spec
        return dataclasses.replace(self.spec, partitions=count)

    def _retire(self, spec: StreamSpec) -> None:
        """After a resize, delete the assignment of partitions the layout no longer has
        (a shrink's, once drained); fenced on our leadership."""
        stale = sorted(p for p in self.mirror.assignment if p >= spec.partitions)
        if self.mirror.resize is None or not stale:  # never resized: nothing is beyond
            return
        fence = self.election.fence
        assert fence is not None
        done = self.group.unassign(fence, stale)
        for p in done:
            self.mirror.assignment.pop(p, None)
        self._wrote_all(done, stale, "unassigning retired partitions")
        log.info("%s: %d partitions retired by a resize unassigned", self.stream, len(done))

    def _wrote_all(self, done: list[int], asked: list[int], what: str) -> None:
        """A fenced write that did less than ``asked`` found another leader: step down."""
        if len(done) < len(asked):
            self._step_down()
            raise NotLeader(f"lost leadership while {what}")

    def _lead(self, event: CoordinatorEvent) -> None:
        """Carry out the operator requests, then (once settled) the automatic step."""
        spec, config = self._served(), self.config
        self._retire(spec)
        self._remove_forged_claims()
        taken = policy.takeovers(self.mirror)
        if taken:  # a standby took these from a dead owner: the assignment follows, at once
            self._write(taken, "takeover")
        for name, request in sorted(self.mirror.requests.items()):
            step = policy.requested(request, spec, self.mirror, config.max_moves, self.loads)
            self._carry_out(step, name)
        if isinstance(event, LoadTick):
            self._measure_loads(spec)
        if not config.manual and policy.settled(self._settle_at, time.monotonic()):
            self._plan(event)
        self._write_standbys(policy.standbys(spec, self.mirror, config.standby))
        # last: two historic reads per record, which nothing above depends on
        self._remove_forged_parked()

    def _plan(self, event: CoordinatorEvent) -> None:
        spec, config = self._served(), self.config
        self._settle_at = None
        load_moves: int | None = None  # by load: as many as it takes (a member came or went)
        members = frozenset(self.mirror.members)
        if self.loads is not None and members == self._planned_members:
            load_moves = config.load_moves if isinstance(event, LoadTick) else 0
        step = policy.automatic(
            spec,
            self.mirror,
            min_members=config.min_members,
            max_moves=config.max_moves,
            first=not self._assigned_once,
            after_claim=isinstance(event, WatchEvent) and event.kind == "claim",
            loads=self.loads,
            load_moves=load_moves,
            reason="load" if load_moves else None,
        )
        if step is not None:
            self._carry_out(step)
            self._planned_members = members

    def _measure_loads(self, spec: StreamSpec) -> None:
        """Each partition's load now (:func:`partq.coordinator.leader.loads.estimate`): the rates
        in the
        members' fresh load reports, and the queues' depths and growth. What cannot be had
        (etcd or RabbitMQ away) is left out, logged at warning."""
        now = time.time()
        rates: dict[int, float] = {}
        try:
            reports = self.group.loads()
        except EtcdError as e:  # away, or a role without read on the reports: balance on
            log.warning("%s: cannot read the load reports: %s", self.stream, e)
            reports = {}
        for member, report in sorted(reports.items()):
            if member in self.mirror.members and report.fresh(now):
                for p, rate in report.rates.items():
                    rates[p] = rates.get(p, 0.0) + rate
        depths: dict[int, int] = {}
        if self._depths is not None:
            try:
                depths = dict(self._depths(spec))
            except PartqError as e:
                log.warning("%s: cannot read the queue depths: %s", self.stream, e)
        previous, elapsed = {}, 0.0
        if self._depth_sample is not None:
            elapsed = time.monotonic() - self._depth_sample[0]
            previous = self._depth_sample[1]
        if depths:
            self._depth_sample = (time.monotonic(), depths)
        measured = loads.estimate(rates, depths, previous, elapsed, self.config.horizon)
        self.loads = loads.smooth(self.loads or {}, measured)  # rates are noisy: an average

    def _remove_forged_claims(self) -> None:
        """Delete the claims and leader candidates partq never writes
        (:mod:`partq.coordinator.leader.forged`)."""
        fence = self.election.fence
        assert fence is not None
        forged.remove_candidates(self.group, fence, self._refusals, self._forged_candidates)
        forged.remove_claims(self.group, fence, self._refusals, self.mirror)
        forged.remove_unbound(
            self.group,
            fence,
            self._refusals,
            self.mirror,
            self._unbound,
            time.monotonic(),
            self.config.unbound_grace,
        )

    def _remove_forged_parked(self) -> None:
        """Delete the parked records their partition's holder did not write."""
        fence = self.election.fence
        assert fence is not None and self.spec is not None
        forged.remove_parked(
            self.group, fence, self._refusals, self.mirror, self._unverified, self.spec
        )

    def _write_standbys(self, target: Mapping[int, str]) -> None:
        """Put (and delete) the standby keys that differ from ``target``, fenced."""
        current = self.mirror.standbys
        changes: list[tuple[int, str | None]] = [
            (p, m) for p, m in sorted(target.items()) if current.get(p) != m
        ]
        changes += [(p, None) for p in sorted(current) if p not in target]
        if not changes:
            return
        for p, _m in changes:  # the standby is not what we wrote: another identity's
            if p in self._named and current.get(p) != self._named[p]:
                metrics.FORGED_REMOVED.labels(self.stream, "standby").inc()
                log.warning("%s: the standby key of partition %d names %s, not %s as we "
                            "wrote it: putting ours back", self.stream, p, current.get(p),
                            self._named[p])  # fmt: skip
        fence = self.election.fence
        assert fence is not None
        written = self.group.name_standbys(fence, changes)
        for p in written:
            if p in target:
                current[p] = self._named[p] = target[p]
            else:
                current.pop(p, None)
                self._named.pop(p, None)
        self._wrote_all(written, [p for p, _ in changes], "writing standbys")

    def _carry_out(self, step: policy.Step, request: str | None = None) -> None:
        if step.ignored:
            log.warning("%s: %s", self.stream, step.ignored)
        if step.target is not None:
            self._write(step.target, step.reason)
            if step.planned:
                self._assigned_once = True
        if step.clear and request is not None:
            self.group.clear_request(request)

    def _write(self, target: Mapping[int, str], reason: str) -> None:
        """Write the partitions whose owner changes, fenced on our leadership."""
        fence = self.election.fence
        assert fence is not None
        assignment = self.mirror.assignment
        changed = sorted(p for p, owner in target.items() if assignment.get(p) != owner)
        if not changed:
            return
        written = self.group.assign(fence, {p: target[p] for p in changed})
        assignment.update((p, target[p]) for p in written)
        self._wrote_all(written, changed, "writing the assignment")
        moved = sum(1 for p in changed if p in self.mirror.claims)
        metrics.REBALANCES.labels(self.stream, reason).inc()
        metrics.PARTITIONS_MOVED.labels(self.stream).inc(moved)
        self.history.rebalanced(reason, len(changed))
        log.info(
            "%s: assignment %s: %d partitions changed owner", self.stream, reason, len(changed)
        )

    # -- metrics ---------------------------------------------------------------------------

    def _export(self) -> None:
        if self.spec is None:
            return
        spec, mirror = self._served(), self.mirror
        owned = policy.owned(spec, mirror)
        metrics.MEMBERS.labels(self.stream).set(len(mirror.members))
        metrics.PARTITIONS_UNASSIGNED.labels(self.stream).set(spec.partitions - len(owned))
        in_motion = policy.in_motion(owned, mirror.claims)
        metrics.PARTITIONS_IN_MOTION.labels(self.stream).set(len(in_motion))
        metrics.IMBALANCE.labels(self.stream).set(policy.imbalance(spec, mirror.members, owned))
        unbound = policy.unbound_claims(mirror.members, mirror.claims)
        metrics.CLAIMS_UNBOUND.labels(self.stream).set(len(unbound) + len(mirror.forged))
        metrics.PARKED_KEYS.labels(self.stream).set(len(mirror.parked))
        if self.loads is not None and self.leading.is_set():
            metrics.LOAD_SPREAD.labels(self.stream).set(self._load_spread(spec, owned))
        if self.leading.is_set():
            self._export_assignment(
                {(self.stream, str(p), owner, spec.queue(p)) for p, owner in owned.items()}
            )

    def _load_spread(self, spec: StreamSpec, owned: Mapping[int, str]) -> float:
        """The most loaded member's load over the mean (1.0 without members or loads)."""
        weights = {m.id: m.weight for m in self.mirror.members.values()}
        levels = loads.member_loads(owned, self.loads or {}, weights)
        mean = sum(levels.values()) / len(levels) if levels else 0.0
        return max(levels.values()) / mean if mean > 0 else 1.0

    def _export_assignment(self, series: set[tuple[str, str, str, str]]) -> None:
        """Make this stream's ``partq_assignment_info`` series exactly ``series`` (other
        streams' series, of other coordinators in this process, are left alone)."""
        for labels in self._exported - series:
            metrics.ASSIGNMENT_INFO.remove(*labels)
        for labels in series - self._exported:
            metrics.ASSIGNMENT_INFO.labels(*labels).set(1)
        self._exported = series

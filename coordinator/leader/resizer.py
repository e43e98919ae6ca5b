"""The shell of a resize: carries out :mod:`partq.coordinator.leader.resize`'s actions on RabbitMQ
and etcd.

``partq stream resize`` runs it with the admin's credentials (the coordinator has no
RabbitMQ right; docs/resize.md). The record at :func:`partq.kernel.keys.resize` makes it
resumable: it is written, by a compare-and-set on its mod revision, *before* the actions
of its phase run, and every action is idempotent, so a command killed anywhere is
continued by running it again with the same count (:meth:`Resizer.start` resumes a
running resize of that count and refuses any other).

=========  ==========================================================================
action     carried out as
=========  ==========================================================================
Declare    the added partition queues, with the stream's arguments and no binding
Unbind     every binding of the old epoch removed (old-layout publishes are returned)
Fence      a fence (:func:`partq.producer.topology.publish_fence`), confirmed, per old queue
Bind       every binding of the new epoch made
Switch     the spec compare-and-set to the new count and epoch (found done: done)
(waiting)  the drained keys of the old epoch read (:func:`partq.kernel.keys.drained_prefix`)
Delete     a retired queue deleted only at 0 messages and 0 consumers
           (:func:`partq.producer.topology.delete_if_empty`); one that is not: ``NotEmpty``
=========  ==========================================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pika
from etcd3.utils import prefix_range_end
from partq.coordinator.leader import resize
from partq.coordinator.leader.resize import Action, Event, Phase, State
from partq.coordinator.ops.dlq import sender
from partq.coordinator.store import codec
from partq.producer import topology
from partq.producer.contract import (
    MAX_PARTITIONS,
    StreamSpec,
    group_scope,
    queue_name,
    seal_digest,
)
from partq.producer.registry import Registry

from partq.kernel import keys
from partq.kernel.amqp import AmqpURL, blocking_connection
from partq.kernel.errors import EtcdUnavailable, MalformedValue, PartqError, UsageError
from partq.kernel.etcd import etcd_errors

__all__ = ["ResizeTimeout", "Resizer", "read_record"]

log = logging.getLogger("partq.resize")

_ORDER = list(Phase)


class ResizeTimeout(PartqError):
    """The resize did not reach the phase asked for in time; running again continues it."""


def read_record(registry: Registry, stream: str) -> tuple[State | None, int]:
    """``stream``'s resize record and its mod revision ((None, 0) when it has none)."""
    with etcd_errors(registry.where):
        raw, meta = registry.client.get(keys.resize(stream))
    if raw is None:
        return None, 0
    return resize.decode(raw), int(meta.mod_revision)


@dataclass
class Resizer:
    """One ``partq stream resize`` run: :meth:`start`, then :meth:`run`.

    ``written`` is called with each record once it is stored, before its actions run
    (tests stop the run there, as a kill would)."""

    registry: Registry
    amqp_url: AmqpURL
    stream: str
    maximum: int = MAX_PARTITIONS
    interval: float = 0.25  # seconds between looks while waiting for the consumers
    written: Callable[[State], None] | None = None
    seal: Callable[[], str] = field(default=lambda: secrets.token_hex(16))  # a fence's seal
    state: State | None = field(default=None, init=False)
    resumed: bool = field(default=False, init=False)  # start() found it running
    _revision: int = field(default=0, init=False)  # the record's mod revision, ours last
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _etcd_away: bool = field(default=False, init=False)  # the last read of drained keys failed
    _kept: set[str] = field(default_factory=set, init=False)  # retired queues found not empty
    # the drained records without a seal of ours logged, by (partition, revision)
    _unsealed: set[tuple[str, int, int]] = field(default_factory=set, init=False)

    @property
    def phase(self) -> str:
        """The recorded phase, as the commands print it."""
        return self.state.phase.value if self.state is not None else "not started"

    # -- the record ------------------------------------------------------------------------

    def start(self, partitions: int) -> State:
        """Begin the resize to ``partitions`` (the record written), or resume the running
        one if it goes to the same count. :class:`UsageError` in one line otherwise: a
        resize to another count runs, the count is out of range or is the current one."""
        spec = self.registry.read_spec(self.stream)
        running, self._revision = read_record(self.registry, self.stream)
        if running is not None and running.running and running.resize.new.partitions == partitions:
            self._check_spec(spec, running)
            self.state, self.resumed = running, True
            phase = running.phase.value
            log.info("%s: resuming the resize to %d (%s)", self.stream, partitions, phase)
            return running
        state, _actions = resize.begin(spec.layout, partitions, running, self.maximum)
        self._write(state, self._forget_drained(state))
        return state

    def _forget_drained(self, state: State) -> list[Any]:
        """With a new resize's record, the drained keys of the last one (its old epoch is
        this one's minus 1) go: nothing reads another epoch's than the running resize's
        (the gates, the leader and this command read ``state.resize.old.epoch``'s). Each
        start removes the last's, so at most one resize's keys are ever kept."""
        epoch = state.resize.old.epoch - 1
        if epoch < 0:
            return []
        t = self.registry.client.transactions
        prefixes = [keys.drained_prefix(scope, epoch).encode() for scope in self._scopes()]
        return [t.delete(prefix, prefix_range_end(prefix)) for prefix in prefixes]

    def _check_spec(self, spec: StreamSpec, state: State) -> None:
        if spec.layout not in (state.resize.old, state.resize.new):
            raise UsageError(
                f"stream {self.stream!r} has {spec.partitions} partitions in epoch {spec.epoch}, "
                f"which is neither side of its recorded resize ({_sides(state)}): the spec was "
                f"changed by hand; restore it or delete {keys.resize(self.stream)}"
            )

    def _write(self, state: State, also: list[Any] | None = None) -> None:
        """Store ``state`` if the record is still the one we read or wrote last (and do the
        operations ``also`` in the same transaction)."""
        key, client = keys.resize(self.stream), self.registry.client
        t = client.transactions
        found = t.mod(key) == self._revision if self._revision else t.version(key) == 0
        with etcd_errors(self.registry.where):
            ok, responses = client.transaction(
                compare=[found],
                success=[t.put(key, resize.encode(state)), *(also or [])],
                failure=[],
            )
        if not ok:
            raise UsageError(
                f"the resize record of {self.stream!r} was changed by someone else (another "
                f"`partq stream resize`?): run the command again to continue from it"
            )
        self._revision = int(responses[0].response_put.header.revision)
        self.state = state
        if self.written is not None:
            self.written(state)

    # -- carrying it out -------------------------------------------------------------------

    def run(self, until: Phase, timeout: float) -> State:
        """Carry out the resize until it reaches ``until`` (or retires); the state then.
        :class:`ResizeTimeout` after ``timeout`` seconds, the record kept as it is."""
        assert self.state is not None, "start() first"
        deadline = time.monotonic() + timeout
        spec = self.registry.read_spec(self.stream)
        with blocking_connection(self.amqp_url, name=f"partq-resize-{self.stream}") as connection:
            user = sender(connection, spec.exchange)
            while not self._reached(until):
                before = self.state
                self._apply(self._work(connection, spec, user))
                if self.state is before and not self._reached(until):
                    if time.monotonic() >= deadline:
                        raise ResizeTimeout(self._stuck(until, timeout))
                    self._stop.wait(self.interval)
        return self.state

    def _reached(self, until: Phase) -> bool:
        assert self.state is not None
        phase = self.state.phase
        return phase is Phase.RETIRED or _ORDER.index(phase) >= _ORDER.index(until)

    def _apply(self, events: list[Event]) -> None:
        """Step the state through ``events`` and store the result once, if it changed."""
        assert self.state is not None
        state = self.state
        for event in events:
            state, _actions = resize.step(state, event)
        if state != self.state:
            if state.phase is not self.state.phase:
                target = state.resize.new.partitions
                log.info("%s: resize to %d: %s", self.stream, target, state.phase.value)
            self._write(state)

    def _work(
        self, connection: pika.BlockingConnection, spec: StreamSpec, user: str
    ) -> list[Event]:
        """Carry out what the phase still needs: the events seen."""
        assert self.state is not None
        state = self.state
        if state.phase is Phase.SWITCHED:
            try:
                events = self._drained(state)
            except EtcdUnavailable as e:  # a read only: wait for etcd within the timeout
                if not self._etcd_away:
                    log.warning("%s: cannot read the drained keys (%s): waiting", self.stream, e)
                self._etcd_away = True
                return []
            self._etcd_away = False
            return events
        # DRAINED: a queue noted not empty is still pending, so each round tries it again
        actions = resize.pending(state)
        seals = self._seal_fences(actions)
        groups = self._groups(spec) if actions else [spec]
        return [self._do(connection, groups, user, action, seals) for action in actions]

    def _groups(self, spec: StreamSpec) -> list[StreamSpec]:
        """``spec`` for each group of the stream: a resize changes every group's queues."""
        return [spec, *(spec.in_group(g) for g in self.registry.list_groups(self.stream))]

    def _scopes(self) -> list[str]:
        """Each group's scope: a resize forgets and waits for every group's drained keys."""
        groups = self.registry.list_groups(self.stream)
        return [self.stream, *(group_scope(self.stream, g) for g in groups)]

    def _seal_fences(self, actions: list[Action]) -> dict[int, str]:
        """A new seal for each fence among ``actions`` (by partition), their digests stored
        in the record in one write before any is published: the fence alone carries it. A
        resize an older partq began (its record holds no seals) goes on without."""
        assert self.state is not None
        fences = [a.partition for a in actions if isinstance(a, resize.Fence)]
        if self.state.seals is None:
            return dict.fromkeys(fences, "")
        seals = {p: self.seal() for p in fences}
        if seals:
            digests = {(p, seal_digest(seal)) for p, seal in seals.items()}
            self._write(dataclasses.replace(self.state, seals=self.state.seals | digests))
        return seals

    def _do(
        self,
        connection: pika.BlockingConnection,
        specs: StreamSpec | list[StreamSpec],
        user: str,
        action: Action,
        seals: dict[int, str] | None = None,
    ) -> Event:
        """Carry out ``action`` on the queues of each group of ``specs``."""
        groups = specs if isinstance(specs, list) else [specs]
        match action:
            case resize.Declare(partitions):
                for spec in groups:
                    topology.declare_partition_queues(connection, spec, partitions)
                return resize.Declared()
            case resize.Unbind(layout):
                assert self.state is not None
                topology.unbind_layout(connection, groups, layout)
                for spec in groups:
                    topology.unbind_fillers(connection, spec, self.state.resize.retired)
                return resize.Cut()
            case resize.Fence(epoch, partition):
                if seals is None or partition not in seals:  # not from _work: sealed here
                    seals = self._seal_fences([action])
                topology.publish_fence(connection, groups, epoch, partition, user, seals[partition])
                return resize.Fenced(partition)
            case resize.Bind(layout):
                topology.bind_layout(connection, groups, layout)
                return resize.Bound()
            case resize.Switch(old, new):
                self._switch(old.partitions, old.epoch, new.partitions, new.epoch)
                return resize.Switched()
            case resize.Delete(partition):
                return self._delete(connection, groups, partition)
        raise AssertionError(f"unknown action {action!r}")

    def _delete(
        self, connection: pika.BlockingConnection, groups: list[StreamSpec], partition: int
    ) -> Event:
        """The retired queue of ``partition`` deleted in each group once empty: Deleted when
        every group's is gone, else NotEmpty (tried again next round)."""
        kept = 0
        for spec in groups:
            queue = queue_name(spec.scope, partition)
            left = topology.delete_if_empty(connection, spec, partition)
            if left is None:
                if queue in self._kept:  # the end of the warning below
                    self._kept.discard(queue)
                    log.info("%s: retired queue %s is empty now: deleted", self.stream, queue)
                continue
            kept += 1
            # tried again each round (``interval``): said once, until it is deleted
            level = logging.DEBUG if queue in self._kept else logging.WARNING
            self._kept.add(queue)
            log.log(level, "%s: retired queue %s is not empty or still consumed (%d "
                    "messages): kept, tried again until it is empty", self.stream, queue,
                    left)  # fmt: skip
        if kept:
            return resize.NotEmpty(partition)
        topology.delete_partition_exchange(connection, groups[0], partition)
        return resize.Deleted(partition)

    def _switch(self, old: int, old_epoch: int, new: int, new_epoch: int) -> None:
        """The spec to ``new`` partitions in ``new_epoch`` if it still holds the old layout
        (a compare-and-set on its mod revision); done already is done."""
        key, client = keys.spec(self.stream), self.registry.client
        with etcd_errors(self.registry.where):
            raw, meta = client.get(key)
        if raw is None:
            raise UsageError(f"stream {self.stream!r} was deleted during its resize")
        spec = StreamSpec.from_json(raw, key)
        if (spec.partitions, spec.epoch) == (new, new_epoch):
            return
        if (spec.partitions, spec.epoch) != (old, old_epoch):
            raise UsageError(
                f"stream {self.stream!r} has {spec.partitions} partitions in epoch {spec.epoch} "
                f"in etcd, not the {old} of epoch {old_epoch} it is resized from: the spec was "
                f"changed by hand during the resize; restore it, then run the command again"
            )
        switched = dataclasses.replace(spec, partitions=new, epoch=new_epoch)
        t = client.transactions
        with etcd_errors(self.registry.where):
            ok, _ = client.transaction(
                compare=[t.mod(key) == int(meta.mod_revision)],
                success=[t.put(key, switched.to_json())],
                failure=[],
            )
        if not ok:  # changed since the read: look again (it may be our own, earlier switch)
            self._switch(old, old_epoch, new, new_epoch)

    def _drained(self, state: State) -> list[Event]:
        """The old partitions whose consumer recorded its fence handled, in every group."""
        each = [self._drained_in(state, scope) for scope in self._scopes()]
        return [resize.Drained(state.resize.old.epoch, p) for p in sorted(set.intersection(*each))]

    def _drained_in(self, state: State, scope: str) -> set[int]:
        """The old partitions whose consumer in the group ``scope`` names recorded its fence."""
        epoch = state.resize.old.epoch
        prefix = keys.drained_prefix(scope, epoch)
        with etcd_errors(self.registry.where):
            found = list(self.registry.client.get_prefix(prefix))
        events: set[int] = set()
        for value, meta in found:
            name = meta.key.decode("utf-8", errors="replace")[len(prefix) :]
            with contextlib.suppress(MalformedValue):  # not a drained key: not ours to read
                drained = codec.decode_drained(self.stream, f"{epoch}/{name}", value, 0)
                if state.sealed_by(drained.partition, drained.seal):
                    events.add(drained.partition)
                elif (scope, drained.partition, int(meta.mod_revision)) not in self._unsealed:
                    self._unsealed.add((scope, drained.partition, int(meta.mod_revision)))
                    log.warning(
                        "%s: ignoring the drained record of old partition %d naming %s: it "
                        "carries no seal of a fence of this resize, so it was written with a "
                        "consumer's credentials without handling the fence",
                        scope,
                        drained.partition,
                        drained.member,
                    )
        return events

    def _stuck(self, until: Phase, timeout: float) -> str:
        assert self.state is not None
        state = self.state
        what = f"the resize of {self.stream} to {state.resize.new.partitions} partitions"
        if state.phase is Phase.SWITCHED and self._etcd_away:
            why = "etcd could not be reached to read the old partitions' drained keys"
        elif state.phase is Phase.SWITCHED:
            left = sorted(set(range(state.resize.old.partitions)) - state.drained)
            why = (
                f"old partitions not drained yet: {resize.ranges(left)} (their consumers must run)"
            )
        elif state.phase is Phase.DRAINED:
            kept = resize.ranges(state.not_empty)
            why = f"retired queues not empty or still consumed: {kept}"
        else:
            why = "the broker steps did not finish"
        return (
            f"{what} is {state.phase.value} after {timeout:g} s, not {until.value}; {why}. "
            f"Run `{resize.command_line(self.stream, state.resize.new.partitions, wait=True)}` "
            f"again to continue"
        )


def _sides(state: State) -> str:
    old, new = state.resize.old, state.resize.new
    return f"{old.partitions} in epoch {old.epoch} -> {new.partitions} in epoch {new.epoch}"

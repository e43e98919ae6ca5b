"""A consumer's side of a resize (docs/resize.md): the gate, and the fences it records.

A message published under a resize's new layout (its routing key ``"E.q"`` names the
epoch) of a key that moved may be handled only once the key's old partition handled its
fence (:meth:`partq.producer.layout.Resize.gate`): every message of the key published under the
old layout is handled then. :class:`ResizeGate` knows the resize from its etcd record
(``keys.resize``, ``partq.coordinator.leader.resize.encode``) and which old partitions handled their
fence from the drained keys (``keys.drained``, written here by whichever member handled
the fence, and listed in the record by ``partq stream resize``); a drained key counts only
if it carries the seal of its partition's fence, whose digest the record holds (anyone
with a consumer's credentials can write a drained key, only the fence's consumer knows
the seal); it answers :meth:`ResizeGate.waits_for`
per delivery, and wakes whoever waits when a gate opens. Old-layout messages are never
gated; a message of a layout newer than any resize read yet waits for its record.

Threads. The etcd watch thread applies changes (``_apply``); a worker thread asks
(``waits_for``, ``wait``) and records a fence (:meth:`ResizeGate.drained`); the controller
starts and closes it and tells the spec's epoch. ``_changed`` (a condition) guards the
record, the drained sets and the listeners; a listener is called outside it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from partq.coordinator import metrics
from partq.coordinator.leader import resize
from partq.coordinator.store import codec
from partq.producer.layout import parse_routing_key

from partq.kernel import keys
from partq.kernel.backoff import Backoff
from partq.kernel.errors import EtcdError, MalformedValue
from partq.kernel.etcd import EtcdClient, etcd_errors

__all__ = ["WAITING_FOR_RECORD", "ResizeGate"]

log = logging.getLogger("partq.consumer")

WAITING_FOR_RECORD = -1  # waits_for: a layout newer than any resize read here yet
_RETRY = Backoff()  # reading and watching again after etcd failed: 0.2 s doubling to 5 s
_LOOK = 1.0  # seconds between a waiting worker's looks at whether it should give up


class ResizeGate:
    """The resize of one stream as this member sees it (the module docstring)."""

    def __init__(self, client: EtcdClient, where: str, stream: str, member: str, epoch: int):
        self.client = client
        self.where = where
        self.stream = stream
        self.member = member
        self._changed = threading.Condition()
        self._record: resize.State | None = None
        self._revision = 0  # of the record read
        self._drained: dict[int, set[int]] = {}  # epoch -> old partitions that handled its fence
        # epoch -> old partition -> (seal, member) of its drained record, believed only
        # when the record holds the seal's digest (_sealed); those not, once logged
        self._seals: dict[int, dict[int, tuple[str, str]]] = {}
        self._unsealed: set[tuple[int, str, str]] = set()
        self._epoch = epoch  # the spec's: a resize up to it is done if no record says otherwise
        self._loaded = False  # the record and the drained keys were read once
        self._listeners: list[Callable[[], None]] = []
        self._watches: list[int] = []
        self._closed = threading.Event()
        # every epoch's drained keys: keys.drained_prefix(stream, epoch) for each epoch
        self._prefix = keys.drained_all(stream)

    # -- reading and watching etcd -----------------------------------------------------------

    def start(self) -> None:
        """Watch, then read (a change between the two is applied twice, harmlessly); on
        failure, retried on a thread until it works or the gate is closed."""
        try:
            self._start()
        except EtcdError as e:
            log.warning("cannot read the resize of %s: %s; retrying", self.stream, e)
            threading.Thread(target=self._restart, name="resize-gate", daemon=True).start()

    def _start(self) -> None:
        with etcd_errors(self.where):
            # the record by its key alone: a group's roles may read only that key of the
            # stream's (docs/groups.md); the drained keys are the group's own
            self._watches.append(
                self.client.add_watch_callback(keys.resize(self.stream), self._on_response)
            )
            self._watches.append(
                self.client.add_watch_prefix_callback(self._prefix, self._on_response)
            )
            raw, meta = self.client.get(keys.resize(self.stream))
            drained = list(self.client.get_prefix(self._prefix))
        if raw is not None:
            self._put_record(raw, int(meta.mod_revision))
        for value, kv in drained:
            self._put_drained(kv.key.decode(errors="replace"), value)
        with self._changed:
            self._loaded = True
        self._tell()

    def _restart(self) -> None:
        delays = _RETRY.delays()
        while not self._closed.wait(delays.next()):
            self._unwatch()
            try:
                self._start()
                return
            except EtcdError as e:
                log.warning("cannot read the resize of %s: %s; retrying", self.stream, e)

    def _on_response(self, response: Any) -> None:
        if response is None or isinstance(response, Exception):
            if not self._closed.is_set():
                log.warning(
                    "the resize watch of %s ended (%s): reading again", self.stream, response
                )
                threading.Thread(target=self._restart, name="resize-gate", daemon=True).start()
            return
        for event in response.events:
            key = event.key.decode(errors="replace")
            if type(event).__name__ == "DeleteEvent":
                continue  # a record or drained key deleted: what it said stays true
            if key == keys.resize(self.stream):
                self._put_record(event.value, int(event.mod_revision))
            else:
                self._put_drained(key, event.value)
        self._tell()

    def _put_record(self, raw: bytes, revision: int) -> None:
        try:
            state = resize.decode(raw)
        except MalformedValue as e:
            log.error("stream %s: %s: new-layout messages wait", self.stream, e)
            return
        with self._changed:
            if revision < self._revision:
                return
            self._record, self._revision = state, revision
            self._drained.setdefault(state.resize.old.epoch, set()).update(state.drained)

    def _put_drained(self, key: str, raw: bytes) -> None:
        if not key.startswith(self._prefix):
            return
        name = key[len(self._prefix) :]
        try:
            found = codec.decode_drained(self.stream, name, raw, 0)
        except MalformedValue as e:
            log.warning("stream %s: ignoring the drained key %s: %s", self.stream, name, e)
            metrics.MALFORMED_VALUES.labels(self.stream, "drained").inc()
            return  # not what partq writes (keys.drained): it records no fence
        with self._changed:
            self._seals.setdefault(found.epoch, {})[found.partition] = (found.seal, found.member)

    def _sealed(self, record: resize.State, partition: int) -> bool:
        """Whether old ``partition`` has a drained record carrying a seal of its fence
        (:meth:`partq.coordinator.leader.resize.State.sealed_by`); one that does not is
        logged and counted once."""
        seal, member = self._seals.get(record.resize.old.epoch, {}).get(partition, ("", ""))
        if not member:
            return False
        if record.sealed_by(partition, seal):
            return True
        if (partition, seal, member) not in self._unsealed:
            self._unsealed.add((partition, seal, member))
            metrics.MALFORMED_VALUES.labels(self.stream, "drained").inc()
            log.warning(
                "stream %s: ignoring the drained record of old partition %d naming %s: it "
                "carries no seal of that partition's fence, so it was written with a "
                "consumer's credentials without handling the fence",
                self.stream,
                partition,
                member,
            )
        return False

    def _tell(self) -> None:
        with self._changed:
            self._changed.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    # -- what workers ask -------------------------------------------------------------------

    def spec_epoch(self, epoch: int) -> None:
        """The stream's spec is at ``epoch`` now (the controller)."""
        with self._changed:
            self._epoch = max(self._epoch, epoch)
        self._tell()

    def waits_for(self, routing_key: str, key: str | bytes | None) -> int | None:
        """None if a delivery on ``routing_key`` of ``key`` may be handled now; else the old
        partition whose fence it waits for (:data:`WAITING_FOR_RECORD`: the resize's
        record). Old-layout messages, and routing keys that name no layout, never wait."""
        if "." not in routing_key:  # epoch 0 (or no partq routing key): never gated
            return None
        try:
            epoch, _partition = parse_routing_key(routing_key)
        except ValueError:
            return None
        with self._changed:
            record, loaded = self._record, self._loaded
            if record is None or epoch > record.resize.new.epoch:
                done = loaded and record is None and epoch <= self._epoch
                return None if done else WAITING_FOR_RECORD
            change = record.resize
            if epoch < change.new.epoch:
                return None
            gate = None if key is None else change.gate(key)
            if gate is None or gate in self._drained.get(change.old.epoch, ()):
                return None
            return None if self._sealed(record, gate) else gate

    def wait(self, routing_key: str, key: str | bytes | None, give_up: Callable[[], bool]) -> bool:
        """Until a delivery may be handled (True) or ``give_up()`` says so (False)."""
        with self._changed:
            while self.waits_for(routing_key, key) is not None:
                if give_up():
                    return False
                self._changed.wait(_LOOK)
        return True

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (quick, never raising) whenever a gate may have opened."""
        with self._changed:
            self._listeners.append(listener)

    def unlisten(self, listener: Callable[[], None]) -> None:
        with self._changed:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def drained(self, epoch: int, partition: int, seal: str) -> None:
        """Old ``partition`` handled the fence of ``epoch``, sealed ``seal``: recorded in
        etcd (not on a lease: it stays true), then here. Raises :class:`EtcdError`."""
        value = codec.encode_drained(self.member, seal)
        with etcd_errors(self.where):
            self.client.put(keys.drained(self.stream, epoch, partition), value)
        with self._changed:
            self._drained.setdefault(epoch, set()).add(partition)
        self._tell()

    def close(self) -> None:
        self._closed.set()
        self._unwatch()

    def _unwatch(self) -> None:
        watches, self._watches = self._watches, []
        for watch in watches:
            try:
                self.client.cancel_watch(watch)
            except Exception:  # etcd gone: the watch ends with the client
                log.debug("cancelling a resize watch failed", exc_info=True)

"""A producer's view of its stream's layout: the newest spec etcd has, pushed by a watch.

A resize (docs/resize.md) cuts the old epoch's bindings before it switches the spec, so a
producer that publishes under the old layout meanwhile gets its messages returned. It then
waits here (bounded) for a spec of a newer epoch, and republishes under it. The watch
pushes the switch; should the watch be down, :meth:`SpecFollower.wait_newer` asks etcd
itself every ``_POLL`` seconds, so a lost watch costs latency, never a message.

Threads. The etcd watch stream's thread calls ``_seen`` (it replaces ``spec`` whole and
calls ``on_change``); the producer's waiter thread calls :meth:`wait_newer`; any thread
reads ``spec`` (one reference). ``_changed`` (a condition) guards nothing but the wait.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from partq.producer.contract import StreamSpec

from partq.kernel.errors import PartqError

__all__ = ["SpecFollower", "SpecWatcher", "resizing_to"]

log = logging.getLogger("partq.producer")

_POLL = 1.0  # seconds between two reads of etcd while waiting, should the watch be down


class SpecWatcher(Protocol):
    """What a producer's spec source offers beyond ``read_spec`` to follow resizes
    (``partq.producer.registry.Registry`` does)."""

    def read_spec(self, stream: str) -> StreamSpec: ...

    def watch_spec(self, stream: str, on_spec: Callable[[StreamSpec | None], None]) -> int: ...

    def cancel_watch(self, watch_id: int) -> None: ...

    def read_resize(self, stream: str) -> bytes | None: ...


class SpecFollower:
    """The newest layout of one stream (the module docstring)."""

    def __init__(
        self,
        source: SpecWatcher,
        spec: StreamSpec,
        on_change: Callable[[StreamSpec], None],
    ) -> None:
        self.spec = spec
        self._source = source
        self._on_change = on_change
        self._changed = threading.Condition()
        self._watch: int | None = None
        try:
            self._watch = source.watch_spec(spec.name, self._seen)
        except PartqError as e:  # etcd away now: a return will read the spec itself
            log.warning("cannot watch the spec of %s: %s; reading it on a return", spec.name, e)

    def _seen(self, spec: StreamSpec | None) -> None:
        """A spec read or pushed: kept if it is of a newer epoch (a deleted or older spec
        changes nothing: a producer never goes back to an older layout)."""
        if spec is None or spec.name != self.spec.name:
            return
        with self._changed:
            if spec.epoch <= self.spec.epoch:
                return
            self.spec = spec
            self._changed.notify_all()
        log.info(
            "stream %s: layout epoch %d, %d partitions", spec.name, spec.epoch, spec.partitions
        )
        self._on_change(spec)

    def resizing(self) -> bool:
        """Whether etcd holds a resize of the stream that has not retired (or cannot tell:
        then True, and the wait is bounded anyway)."""
        try:
            raw = self._source.read_resize(self.spec.name)
        except PartqError:
            return True
        record = _record(raw)
        return record is not False and (record is None or record.get("phase") != "retired")

    def wait_newer(self, epoch: int, timeout: float) -> StreamSpec | None:
        """The spec once its epoch is above ``epoch``; None after ``timeout`` seconds.

        etcd is read first, then every ``_POLL`` seconds between pushes: a producer whose
        spec was stale before the wait began (given pinned, or its watch missed the
        switch) finds the newer layout at once, even with ``timeout`` 0."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._seen(self._source.read_spec(self.spec.name))
            except PartqError as e:
                log.debug("reading the spec of %s while waiting: %s", self.spec.name, e)
            with self._changed:
                if self.spec.epoch > epoch:
                    return self.spec
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(min(left, _POLL))
                if self.spec.epoch > epoch:
                    return self.spec

    def close(self) -> None:
        if self._watch is not None:
            self._source.cancel_watch(self._watch)
            self._watch = None


def _record(raw: bytes | None) -> dict[str, Any] | Literal[False] | None:
    """The resize record ``raw`` as JSON (``partq.coordinator.leader.resize.encode``), False when
    there is
    none, None when it does not parse."""
    if raw is None:
        return False
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def resizing_to(source: SpecWatcher, stream: str) -> int | None:
    """The larger partition count of ``stream``'s resize while one runs, else None (also
    when etcd cannot tell: the producer's queue check then stays strict)."""
    try:
        record = _record(source.read_resize(stream))
        if not record or record.get("phase") == "retired":
            return None
        return max(int(record["old"]["partitions"]), int(record["new"]["partitions"]))
    except (PartqError, KeyError, TypeError, ValueError):
        return None

"""A consumer's stream changing under it: deleted, recreated, resized, grown.

A stream deleted while the consumer runs: ``/readyz`` turns false, a log line says so,
every partition stops (the queues are gone) and the member waits, without a lease, for the
stream to be created again; then it rejoins (or exits with 5 if the partition count changed).

A resize (docs/resize.md) switches the stream's layout epoch: partitions it adds are
consumed as they are assigned (a grow's from the moment its queues are declared), those
it retires stay known until their fence (:func:`widest`).

:class:`StreamLife` is a base class of :class:`partq.consumers.control.daemon.Consumer`.
Threads: its methods run on the daemon's controller thread, which alone reads and writes
``spec``, ``epoch`` and ``deleted``; the changes reach it as watch events on its queue.
"""

from __future__ import annotations

import dataclasses
import logging

from partq.consumers.control.config import EXIT_STREAM_CHANGED
from partq.consumers.control.consumerstate import ConsumerState
from partq.consumers.control.events import Resync
from partq.coordinator.leader import resize
from partq.coordinator.store.group import WatchEvent
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry

from partq.kernel.errors import EtcdError, EtcdUnavailable, MalformedValue

__all__ = ["StreamLife", "widest"]

log = logging.getLogger("partq.consumer")


def widest(registry: Registry, spec: StreamSpec) -> StreamSpec:
    """``spec``, or, while a shrink runs, with its old count: the partitions it retires are
    consumed until their fence (docs/resize.md), so their queues must be known here; while
    a grow runs, with its new count once its queues are declared (``resize.grown``)."""
    try:
        raw = registry.read_resize(spec.name)
        state = None if raw is None else resize.decode(raw)
    except (EtcdError, MalformedValue) as e:
        log.warning("cannot read the resize of %s: %s; consuming its current count", spec.name, e)
        return spec
    if (count := resize.grown(state)) is not None and count > spec.partitions:
        return dataclasses.replace(spec, partitions=count)
    if state is None or not state.running or state.resize.old.partitions <= spec.partitions:
        return spec
    return dataclasses.replace(spec, partitions=state.resize.old.partitions)


class StreamLife(ConsumerState):
    """The stream's changes (the module docstring)."""

    def _stream_deleted(self) -> None:
        """The stream's keys and queues are gone: stop everything, wait for it to come back."""
        if self.deleted:
            return
        self.deleted = True
        log.warning(
            "stream %s was deleted: stopped consuming; waiting for it to be recreated "
            "(not ready until then)",
            self.spec.name,
        )
        self.ready.clear()  # after the line: whoever sees /readyz false finds the reason
        self.partitions.drop()
        self.partitions.forget()
        self.membership.end(revoke=True)  # our member key and claims went with the stream

    def _on_spec(self, spec: StreamSpec | None) -> None:
        """The stream's spec changed: deleted (None), recreated, or resized."""
        if spec is None:
            self._stream_deleted()
        elif not self.deleted and spec.epoch > self.epoch:
            self._resized(spec)
        else:
            self._stream_recreated()

    def _grow_early(self, event: WatchEvent) -> None:
        """A resize record saying a grow declared its queues: the coordinator assigns them
        from now on (``resize.grown``), so their slots are made before the switch."""
        if not isinstance(event.value, resize.State):
            return
        count = resize.grown(event.value)
        if count is not None and count > self.spec.partitions:
            log.info("stream %s grows to %d partitions: consuming them", self.spec.name, count)
            widened = dataclasses.replace(self.spec, partitions=count)
            self.broker.widen(widened)
            self.partitions.widen(widened)
            self.spec = widened

    def _resized(self, spec: StreamSpec) -> None:
        """A resize switched the stream's layout: partitions it adds are consumed as they
        are assigned; those it retires stay known until their fence (docs/resize.md)."""
        log.info(
            "stream %s resized: layout epoch %d, %d partitions (was %d)",
            spec.name,
            spec.epoch,
            spec.partitions,
            self.spec.partitions,
        )
        self.epoch = spec.epoch
        self.resize.spec_epoch(spec.epoch)
        if spec.partitions > self.spec.partitions:
            self.broker.widen(spec)
            self.partitions.widen(spec)
            self.spec = spec

    def _stream_recreated(self) -> None:
        if not self.deleted:
            return
        try:
            spec = self.membership.read_spec()
        except EtcdUnavailable as e:
            log.warning("cannot read the recreated stream's spec: %s; retrying", e)
            self._schedule(Resync())
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
        self._join_when_usable()

"""Rerouting on resize: a producer follows its stream's layout and moves publishes to it.

A resize (docs/resize.md) switches the stream's spec to a layout of a newer epoch. A watch
on etcd (:class:`partq.producer.follow.SpecFollower`) hands the new spec to
:meth:`Rerouter.on_spec`, and later publishes hash to its partitions. A message sent under
the old layout after its bindings were cut comes back from the broker (mandatory): the
ledger keeps it in ``returned`` and holds every later message; once every message sent
before it is settled, :meth:`Rerouter.after_returns` republishes the returned ones, in
order and ahead of the rest, under a newer layout (each encoded again by :meth:`reroute`:
the partition header changes), or, if etcd has none within ``layout_timeout`` (at once
when no resize runs), fails them with :class:`MessageUnroutable`.

Threads. ``spec`` and ``layout`` are replaced whole (one reference each) by the etcd watch's
thread (``on_spec``) or the waiter thread, and read by any thread: a caller's ``publish``
hashes under whichever it reads, and the I/O thread reroutes what was prepared under an
older one before it frames it. The I/O thread runs ``after_returns``, ``reroute`` and the
republish; when it must wait for a newer layout it starts one short-lived waiter thread
(``partq-producer-layout``, at most one at a time: ``_awaiting``), which waits on the
follower and hands the outcome back to the I/O thread with ``add_callback_threadsafe``.
``_awaiting`` and ``rerouted`` change under the ledger's lock, as do the ledger's
``returned`` and ``held`` that this module empties.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Protocol

from partq.producer.contract import StreamSpec
from partq.producer.follow import SpecFollower, SpecWatcher
from partq.producer.layout import Layout
from partq.producer.ledger import Ledger, Pending
from partq.producer.properties import properties_for
from partq.producer.wire import Limits
from pika.adapters.select_connection import SelectConnection

from partq.kernel.errors import MessageUnroutable

__all__ = ["IoThread", "Rerouter", "watcher_of"]

log = logging.getLogger("partq.producer")


def watcher_of(source: object) -> SpecWatcher | None:
    """``source`` if it can watch the spec (a :class:`Registry` can; a plain reader not)."""
    needed = ("watch_spec", "cancel_watch", "read_resize")
    if source is not None and all(callable(getattr(source, n, None)) for n in needed):
        return source  # type: ignore[return-value]
    return None


class IoThread(Protocol):
    """What the rerouting asks of the connection loop."""

    connection: SelectConnection | None  # under the ledger's lock; None while reconnecting

    def wake(self) -> None: ...

    def drain(self) -> None: ...


class Rerouter:
    """One producer's layout, and its returned messages' way to a newer one."""

    def __init__(
        self, spec: StreamSpec, timeout: float, ledger: Ledger, limits: Limits, io: IoThread
    ) -> None:
        self.spec = spec
        self.layout: Layout = spec.layout  # replaced whole when a watch sees a newer epoch
        self.timeout = timeout
        self.follower: SpecFollower | None = None
        self.rerouted = 0  # messages returned by a cut layout and republished under a newer
        self._awaiting = False  # a thread waits for a newer layout in etcd
        self._ledger = ledger
        self._limits = limits
        self._io = io

    def follow(self, watcher: SpecWatcher) -> None:
        self.follower = SpecFollower(watcher, self.spec, self.on_spec)

    def stop_following(self) -> None:
        if self.follower is not None:
            self.follower.close()
            self.follower = None

    def on_spec(self, spec: StreamSpec) -> None:
        """A newer layout (the watch's thread): later publishes use it."""
        self.spec = spec
        self.layout = spec.layout
        self._io.wake()  # messages held for the newer epoch go out

    def reroute(self, pending: Pending, layout: Layout) -> None:
        """``pending`` (prepared under an older layout) routed and encoded under ``layout``:
        the I/O thread's, before it frames the message (same id, same publish time)."""
        partition = layout.partition_for(pending.key)
        encoded, _ = properties_for(
            pending.key,
            partition,
            pending.message_id,
            pending.now,
            pending.headers,
            self._limits.properties,
            refuse_control=False,
        )
        pending.partition = partition
        pending.properties = encoded
        pending.epoch = layout.epoch
        pending.routing_key = layout.routing_key(partition)

    def unroutable(self, pending: Pending, resizing: int | None = None) -> MessageUnroutable:
        """Why ``pending`` fails: its layout (epoch ``resizing``) was cut by a resize and no
        newer one came in time, or (None) its queue is simply not bound."""
        spec = self.spec
        if resizing is not None:
            return MessageUnroutable(
                f"the broker returned a message of {spec.name!r} (partition "
                f"{pending.partition}, layout epoch {resizing}) and etcd had no newer layout "
                f"within {self.timeout:g}s: finish the stream's resize, then publish "
                f"it again"
            )
        return MessageUnroutable(
            f"no queue is bound for partition {pending.partition} of "
            f"{spec.name!r}: run `partq stream create {spec.name} "
            f"--partitions {spec.partitions}` to declare its queues"
        )

    def holding(self, epoch: int) -> None:
        log.warning(
            "stream %s: the broker returned a message of layout epoch %d (its bindings "
            "are cut: a resize): holding publishes until etcd has a newer layout",
            self.spec.name,
            epoch,
        )

    # -- returned messages: wait for a newer layout, then republish (I/O thread) ------------

    def after_returns(self) -> None:
        """Every message sent is settled or returned: republish the returned ones under a
        newer layout if one is known, else wait for one on another thread."""
        ledger = self._ledger
        epoch = max(pending.epoch for pending in ledger.returned.values())
        if self.layout.epoch > epoch:
            self._republish()
            return
        with ledger.lock:
            if self._awaiting:
                return
            self._awaiting = True
        threading.Thread(
            target=self._await_layout, args=(epoch,), name="partq-producer-layout", daemon=True
        ).start()

    def _await_layout(self, epoch: int) -> None:
        """Waiter thread: a layout newer than ``epoch`` (at most ``timeout``; at once none
        when no resize runs: the queue is just not bound), then back to the I/O thread."""
        follower = self.follower
        found = None
        resizing = False
        try:
            if follower is not None:
                resizing = follower.resizing()
                wait = self.timeout if resizing else 0.0
                found = follower.wait_newer(epoch, wait)
        finally:
            with self._ledger.lock:
                self._awaiting = False
                connection = self._io.connection
        if found is not None and found.epoch > self.layout.epoch:
            self.on_spec(found)
        if connection is None:
            return  # reconnecting: the returned messages are sent again, in order
        with contextlib.suppress(Exception):  # the loop is closing: the requeue sends them
            connection.ioloop.add_callback_threadsafe(
                functools.partial(self._layout_waited, epoch, resizing)
            )

    def _layout_waited(self, epoch: int, resizing: bool) -> None:
        ledger = self._ledger
        if not ledger.returned:
            return  # a reconnect requeued them meanwhile
        if self.layout.epoch > epoch:
            self._republish()
            return
        with ledger.lock:
            doomed = ledger.take_returned()
        ledger.resolve([], [(p, self.unroutable(p, epoch if resizing else None)) for p in doomed])
        self._io.drain()

    def _republish(self) -> None:
        """The returned messages ahead of everything not yet sent, in their first order;
        the drain routes them (and every older message) under the current layout."""
        ledger = self._ledger
        with ledger.lock:
            again = ledger.take_returned()
            ledger.outbox.extendleft(reversed(again))
            self.rerouted += len(again)
        log.info(
            "stream %s: republishing %d returned messages under layout epoch %d",
            self.spec.name,
            len(again),
            self.layout.epoch,
        )
        self._io.drain()

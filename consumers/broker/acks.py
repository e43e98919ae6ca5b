"""How the workers' acks reach RabbitMQ: queued by the workers, sent by the I/O loop.

Workers queue their acks (:class:`AckQueue`); the first ack of a burst schedules one
I/O-loop callback, which sends every ack queued meanwhile (one thread hop per burst, not
per message). A worker with more deliveries of its partition already in hand says so
(``more``): its acks are held back, up to :data:`ACK_BATCH` of them or
:data:`ACK_LINGER` seconds, so that they go as one ``basic.ack`` (each is a command in a
quorum queue's log: fewer, larger acks cost the broker less). Held acks go with the next
ack sent without ``more`` or before any other request of the workers
(:meth:`AckQueue.claim`): a worker's last ack before it waits, finishes or gives a
delivery back is never held. Since a held ack needs a delivery in the worker's hands,
it can never hold the window's credit up: the window never waits for one. A run of one
channel's acks that is exactly the oldest of its unacked
deliveries, in delivery order, goes as one ``basic.ack`` with ``multiple`` (:func:`send`);
anything else is acked tag by tag, so a multiple ack never covers a delivery the worker
did not ack.

Threads. :class:`AckQueue` is locked: the workers put, the I/O thread takes. :func:`send`
runs on the I/O thread (``partq.consumers.broker.channels``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque

from pika.channel import Channel

__all__ = ["ACK_BATCH", "ACK_LINGER", "AckQueue", "send"]

ACK_BATCH = 32  # acks a busy worker may hold back (below the default prefetch, 100)
ACK_LINGER = 0.05  # seconds the oldest held ack may wait


class AckQueue:
    """The workers' acks, queued until the I/O loop sends them (thread-safe). A send takes
    the partitions whose acks are due (not held), or every one after a :meth:`claim`."""

    def __init__(self) -> None:
        self._queued: dict[int, list[tuple[Channel, int]]] = {}  # partition -> its acks
        self._since: dict[int, float] = {}  # partition -> when its oldest queued ack came
        self._due: set[int] = set()  # partitions whose acks go with the next send
        self._everything = False  # a claim: the next send takes every partition's
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, partition: int, channel: Channel, delivery_tag: int, more: bool = False) -> bool:
        """Queue one; True if the caller is to schedule a send: none is scheduled yet, and
        the ack may not be held (``more``: the worker has more deliveries in hand)."""
        now = time.monotonic()
        with self._lock:
            queued = self._queued.setdefault(partition, [])
            if not queued:
                self._since[partition] = now
            queued.append((channel, delivery_tag))
            if more and len(queued) < ACK_BATCH and now - self._since[partition] < ACK_LINGER:
                return False
            self._due.add(partition)
            if self._scheduled:
                return False
            self._scheduled = True
            return True

    def claim(self) -> bool:
        """Every queued ack goes with the next send, before a request made now; True if
        none is scheduled yet: the caller sends them first."""
        with self._lock:
            if not self._queued:
                return False
            self._everything = True
            if self._scheduled:
                return False  # scheduled before the request: it runs first
            self._scheduled = True
            return True

    def take(self) -> list[tuple[int, Channel, list[int]]]:
        """The acks to send now, as each channel's in the order queued (channels are
        independent of each other); the next due :meth:`put` schedules a send again."""
        with self._lock:
            due = sorted(self._queued) if self._everything else sorted(self._due)
            taken = [(partition, self._queued.pop(partition, [])) for partition in due]
            self._due.clear()
            self._everything = False
            self._scheduled = False
        runs: dict[tuple[int, int], tuple[int, Channel, list[int]]] = {}
        for partition, acks in taken:
            for channel, tag in acks:
                run = runs.get((partition, id(channel)))
                if run is None:
                    runs[(partition, id(channel))] = (partition, channel, [tag])
                else:
                    run[2].append(tag)
        return list(runs.values())

    def drop(self) -> None:
        """Forget what is queued (a send queued on a dead connection's loop never runs)."""
        with self._lock:
            self._queued.clear()
            self._due.clear()
            self._everything = False
            self._scheduled = False


def send(channel: Channel, unacked: deque[int], tags: tuple[int, ...]) -> None:
    """Ack ``tags`` (in the order the worker acked them) on ``channel``, whose handed-on,
    not yet acked delivery tags are ``unacked`` (in delivery order; updated)."""
    count = len(tags)
    if count > 1 and tuple(itertools.islice(unacked, count)) == tags:
        channel.basic_ack(tags[-1], multiple=True)  # exactly the oldest `count` unacked
        for _ in range(count):
            unacked.popleft()
        return
    for tag in tags:
        channel.basic_ack(tag)
        if unacked and unacked[0] == tag:
            unacked.popleft()
        else:
            with contextlib.suppress(ValueError):
                unacked.remove(tag)

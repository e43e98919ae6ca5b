"""How the workers' acks reach RabbitMQ: queued by the workers, sent by the I/O loop.

Workers queue their acks (:class:`AckQueue`); the first ack of a burst schedules one
I/O-loop callback, which sends every ack queued meanwhile (one thread hop per burst, not
per message). A run of one channel's acks that is exactly the oldest of its unacked
deliveries, in delivery order, goes as one ``basic.ack`` with ``multiple`` (:func:`send`);
anything else is acked tag by tag, so a multiple ack never covers a delivery the worker
did not ack.

Threads. :class:`AckQueue` is locked: the workers put, the I/O thread takes. :func:`send`
runs on the I/O thread (``partq.consumers.broker.drain``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque

from pika.channel import Channel

__all__ = ["AckQueue", "send"]


class AckQueue:
    """The workers' acks, queued until the I/O loop sends them (thread-safe)."""

    def __init__(self) -> None:
        self._acks: list[tuple[int, Channel, int]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, partition: int, channel: Channel, delivery_tag: int) -> bool:
        """Queue one; True if no send is scheduled yet: the caller schedules one."""
        with self._lock:
            self._acks.append((partition, channel, delivery_tag))
            if self._scheduled:
                return False
            self._scheduled = True
            return True

    def take(self) -> list[tuple[int, Channel, list[int]]]:
        """Everything queued, as each channel's acks in the order queued (channels are
        independent of each other); the next :meth:`put` schedules a send again."""
        with self._lock:
            acks, self._acks = self._acks, []
            self._scheduled = False
        runs: dict[tuple[int, int], tuple[int, Channel, list[int]]] = {}
        for partition, channel, tag in acks:
            run = runs.get((partition, id(channel)))
            if run is None:
                runs[(partition, id(channel))] = (partition, channel, [tag])
            else:
                run[2].append(tag)
        return list(runs.values())

    def drop(self) -> None:
        """Forget what is queued (a send queued on a dead connection's loop never runs)."""
        with self._lock:
            self._acks.clear()
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

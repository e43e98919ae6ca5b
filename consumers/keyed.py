"""A partition's worker with ``--concurrency`` above 1: different keys at once, each in order.

Threads. The inbox (a ``SimpleQueue``) is the only way in: deliveries and END from the
pika I/O thread, STOP from the controller, :class:`_Done` from the pool threads. What
each thread owns:

- the **dispatcher** (this worker's thread) owns the partition's :class:`KeyQueues`: it
  takes deliveries, END, STOP and the completions of its own messages from the inbox,
  and hands each delivery whose key is idle to the member's :class:`HandlerPool`;
- a **pool thread** runs one message exactly as the one-at-a-time worker does
  (:meth:`consumers.worker.Worker._process`: retries, parking, dead-lettering, redrive
  control messages, the handler timeout, the ack), then puts :class:`_Done` in the inbox;
- the **HTTP server thread** (a Prometheus scrape) reads ``longest_wait``, one float only
  the dispatcher writes.

So a key never has two messages in a handler and its messages run in arrival order,
while the member has at most ``--concurrency`` messages in handlers at once. A worker's first
message goes ahead of the pool's queue: a partition just handed over starts on the next
free thread instead of behind the member's other partitions' prefetch bursts (which a
worker thread per partition, ``--concurrency 1``, never waits for). Control
messages (``partq dlq redrive``/``purge``) carry their key and queue behind it like any
message. The partition is finished (END: ``Broker.finish``) or given up (STOP) only once
nothing of it is in a handler any more, so a planned handoff releases it only after every
in-flight message is handled and acked, and the partition's next worker in this process
(which joins this one) never overlaps a key. Acks of deliveries whose channel is gone (a
fence aborted the connection) are dropped by the broker, never sent on a new connection.

Fairness. A key's next message goes to the pool the moment its previous one is done, and
the pool is first come, first served over every key and partition of the member; so a
message starts within ``(k + 1) * ceil(R / N) * h`` of its delivery (``k``: messages of
its key held before it, below the prefetch; ``R``: keys with a message held; ``N``: the
concurrency; ``h``: the longest a message takes on a pool thread, retries included). No
key starves however skewed the keys are; docs/operations.md states it and
tests/unit/test_keyorder.py checks it.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import time
from collections.abc import Hashable, Mapping
from typing import Any

from consumers import metrics
from consumers.keyorder import KeyQueues
from consumers.parking import shown_key
from consumers.port import END, Delivery
from consumers.runners import HandlerPool
from consumers.worker import STOP, Worker
from coordinator.codec import MAX_SHOWN_KEY, Concurrency
from kernel import logs
from producer.contract import decode_key, key_bytes

__all__ = ["KeyedWorker", "concurrency_report", "key_of"]

_LOOK = 1.0  # seconds between the dispatcher's looks at its waiting keys when idle


@dataclasses.dataclass(frozen=True, slots=True)
class _Done:
    """A message of ``key`` left the handler; ``go_on`` False: stop (handler timeout, crash)."""

    key: Hashable
    go_on: bool


def key_of(delivery: Delivery) -> Hashable:
    """The key that orders ``delivery``: its bytes (a str key and the same bytes are one key,
    as for the partition hash), None for all messages without a key, and the raw header for
    a key that does not decode (the message is dead-lettered, in its turn)."""
    headers = delivery.properties.headers or {}
    try:
        key = decode_key(headers)
        return None if key is None else key_bytes(key)
    except Exception:
        return ("malformed", repr(sorted(headers.items(), key=lambda kv: str(kv[0]))))


class KeyedWorker(Worker):
    """:class:`~consumers.worker.Worker`'s per-message path, run on ``pool`` key by key."""

    def __init__(self, *, pool: HandlerPool, **options: Any) -> None:
        super().__init__(**options)
        self.pool = pool
        # The key whose delivery had waited longest behind an earlier one of it, and how
        # many seconds, as of the dispatcher's last look (at least once a second); None:
        # none waited. One tuple, replaced whole: read by the HTTP scrape and the report.
        self.waiting: tuple[Hashable, float] | None = None
        self.in_flight = 0  # messages of the partition in a handler (the dispatcher's count)
        self._m_in_flight = metrics.IN_FLIGHT.labels(*self._labels, str(self.partition))

    def _run(self) -> None:  # noqa: C901, PLR0912, PLR0915 — one dispatch loop: deliveries, key slots, stop
        if self.previous is not None:
            self.previous.join()  # never a key in two handlers of this process
        keys: KeyQueues[Delivery] = KeyQueues()
        ending: Any = None  # END's channel once the broker sent it
        halted = False  # STOP, or a message timed out: nothing more starts
        in_flight = 0
        next_look = 0.0  # when the longest wait is looked at again
        first = True  # no message of this subscription started yet: it goes ahead in the pool
        while True:
            try:
                item = self.inbox.get(timeout=_LOOK)
            except queue.Empty:
                item = None
            now = time.monotonic()
            start: Delivery | None = None
            key: Hashable = None  # start's key
            was_in_flight = in_flight
            if item is None:
                pass
            elif item is STOP:
                halted = True
            elif isinstance(item, tuple) and item[0] is END:
                ending = item[1]
            elif isinstance(item, _Done):
                in_flight -= 1
                halted = halted or not item.go_on
                key = item.key  # the key's next delivery, if any, has the same key
                start = keys.done(key)
            else:
                key = key_of(item)
                start = keys.arrive(key, item, now)
            if halted:
                for waiting in keys.take_waiting():
                    self._give_back(waiting)
                if start is not None:
                    keys.done(key)  # it never runs: its key is free again
                    self._give_back(start)
            elif start is not None:
                in_flight += 1
                self.pool.submit(functools.partial(self._run_one, start, key), first=first)
                first = False
            if in_flight != was_in_flight:
                self._show_in_flight(in_flight)
            if in_flight:  # the stall detector's view: waiting only with nothing in a handler
                self.waiting_since = None
            elif self.waiting_since is None:
                self.waiting_since = now
            if now >= next_look:
                self.waiting = keys.longest_waiting(now)
                next_look = now + _LOOK
            if in_flight == 0 and (halted or ending is not None):
                if not halted:
                    self.broker.finish(self.partition, ending)
                return

    def _show_in_flight(self, count: int) -> None:
        self.in_flight = count
        self._m_in_flight.set(count)

    @property
    def longest_wait(self) -> float:
        """Seconds the longest-waiting delivery had waited behind its key (0: none)."""
        waiting = self.waiting
        return 0.0 if waiting is None else waiting[1]

    def _run_one(self, delivery: Delivery, key: Hashable) -> None:
        """On a pool thread: the message's whole path; the dispatcher always hears of it."""
        go_on = False
        try:
            with logs.bind(stream=self.spec.name, member=self.member, partition=self.partition):
                go_on = self._process(delivery)
        except BaseException as error:
            self._crashed(error)
        finally:
            self.inbox.put(_Done(key, go_on))


def concurrency_report(setting: int, workers: Mapping[int, Worker]) -> Concurrency:
    """What ``workers`` (a member's, by partition) hold now, for its load report: messages in
    a handler per partition, and the key that has waited longest behind its own."""
    in_flight = {
        p: w.in_flight if isinstance(w, KeyedWorker) else int(w.busy)
        for p, w in sorted(workers.items())
    }
    waits = [w.waiting for w in workers.values() if isinstance(w, KeyedWorker) and w.waiting]
    if not waits:
        return Concurrency(setting, in_flight)
    key, seconds = max(waits, key=lambda pair: pair[1])
    return Concurrency(setting, in_flight, _shown(key)[:MAX_SHOWN_KEY], round(seconds, 3))


def _shown(key: Hashable) -> str:
    if isinstance(key, bytes):
        return shown_key(key.decode(errors="replace"))
    return "(malformed key header)" if isinstance(key, tuple) else "(no key)"

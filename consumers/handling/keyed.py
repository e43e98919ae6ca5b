"""A partition's worker with ``--concurrency`` above 1: different keys at once, each in order.

Threads. The inbox (a ``SimpleQueue``) is the only way in: deliveries and END from the
pika I/O thread, STOP from the controller, :class:`_Done` from the pool threads. What
each thread owns:

- the **dispatcher** (this worker's thread) owns the partition's :class:`KeyQueues`: it
  takes deliveries, END, STOP and the completions of its own messages from the inbox,
  and hands each delivery whose key is idle to the member's :class:`HandlerPool`;
- a **pool thread** runs one message exactly as the one-at-a-time worker does
  (:meth:`partq.consumers.handling.worker.Worker._process`: retries, parking, dead-lettering,
  redrive
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

import collections
import dataclasses
import functools
import queue
import time
from collections.abc import Hashable, Mapping
from typing import Any

from partq.consumers import metrics
from partq.consumers.broker.port import END, Delivery
from partq.consumers.control.resizing import ResizeGate
from partq.consumers.handling.parking import shown_key
from partq.consumers.handling.runners import HandlerPool
from partq.consumers.handling.worker import STOP, Worker, is_fence
from partq.consumers.state.keyorder import KeyQueues
from partq.coordinator.store.codec import MAX_SHOWN_KEY, Concurrency
from partq.producer.contract import decode_key, key_bytes

from partq.kernel import logs

__all__ = ["KeyedWorker", "concurrency_report", "key_of"]

_LOOK = 1.0  # seconds between the dispatcher's looks at its waiting keys when idle


_WAKE = object()  # an inbox item: a resize gate may have opened


@dataclasses.dataclass(slots=True)
class _Held:
    """What the dispatcher holds back: a resize's ``fence`` until nothing before it is in a
    handler, what arrived ``behind`` it, and the deliveries of ``gated`` keys (in arrival
    order; a key with one gated delivery has all its later ones gated too)."""

    fence: Delivery | None = None
    behind: collections.deque[Delivery] = dataclasses.field(default_factory=collections.deque)
    gated: list[tuple[Hashable, Delivery]] = dataclasses.field(default_factory=list)
    gated_keys: collections.Counter[Hashable] = dataclasses.field(
        default_factory=collections.Counter
    )

    @property
    def empty(self) -> bool:
        return self.fence is None and not self.behind and not self.gated

    def take(self) -> list[Delivery]:
        """Everything held, removed: the gated first (they arrived before the rest)."""
        taken = [delivery for _key, delivery in self.gated]
        taken += [] if self.fence is None else [self.fence]
        taken += self.behind
        self.gated.clear()
        self.gated_keys.clear()
        self.fence = None
        self.behind.clear()
        return taken

    def gates(self, gate: ResizeGate | None, key: Hashable, delivery: Delivery) -> bool:
        """Hold ``delivery`` if its key waits for a resize's gate (True), else False."""
        if gate is None or (key not in self.gated_keys and "." not in delivery.routing_key):
            return False
        if (
            key in self.gated_keys
            or gate.waits_for(delivery.routing_key, _gate_key(key)) is not None
        ):
            self.gated.append((key, delivery))
            self.gated_keys[key] += 1
            return True
        return False

    def opened(
        self, gate: ResizeGate, keys: KeyQueues[Delivery], now: float
    ) -> list[tuple[Hashable, Delivery]]:
        """The gated deliveries whose gate opened, handed to ``keys`` in order: what may
        start now. A key stays gated from its first delivery still waiting on."""
        starts: list[tuple[Hashable, Delivery]] = []
        waiting: set[Hashable] = set()
        kept: list[tuple[Hashable, Delivery]] = []
        for key, delivery in self.gated:
            if key in waiting or gate.waits_for(delivery.routing_key, _gate_key(key)) is not None:
                waiting.add(key)
                kept.append((key, delivery))
                continue
            self.gated_keys[key] -= 1
            if not self.gated_keys[key]:
                del self.gated_keys[key]
            start = keys.arrive(key, delivery, now)
            if start is not None:
                starts.append((key, start))
        self.gated = kept
        return starts


def _gate_key(key: Hashable) -> bytes | None:
    """The key a gate hashes: ``key_of``'s bytes; None (never gated) for none or a malformed one."""
    return key if isinstance(key, bytes) else None


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
    """:class:`~partq.consumers.handling.worker.Worker`'s per-message path, run on ``pool`` key
    by key."""

    def __init__(self, *, pool: HandlerPool, **options: Any) -> None:
        super().__init__(**options)
        self.pool = pool
        # The key whose delivery had waited longest behind an earlier one of it, and how
        # many seconds, as of the dispatcher's last look (at least once a second); None:
        # none waited. One tuple, replaced whole: read by the HTTP scrape and the report.
        self.waiting: tuple[Hashable, float] | None = None
        self.in_flight = 0  # messages of the partition in a handler (the dispatcher's count)
        self._first = True  # the dispatcher's: the first start after a handoff jumps the pool
        self._m_in_flight = metrics.IN_FLIGHT.labels(*self._labels, str(self.partition))

    def _run(self) -> None:
        if self.previous is not None:
            self.previous.join()  # never a key in two handlers of this process
        if self.resize is not None:
            self.resize.listen(self._wake)
        try:
            self._dispatch()
        finally:
            if self.resize is not None:
                self.resize.unlisten(self._wake)

    def _wake(self) -> None:
        """A resize gate may have opened (the etcd watch's thread)."""
        self.inbox.put(_WAKE)

    def _dispatch(self) -> None:  # noqa: C901, PLR0912 — the loop of the module docstring
        keys: KeyQueues[Delivery] = KeyQueues()
        held = _Held()  # a fence waiting for its turn, what came after it, gated keys
        ending: Any = None  # END's channel once the broker sent it
        halted = False  # STOP, or a message timed out: nothing more starts
        in_flight = 0
        next_look = 0.0  # when the longest wait is looked at again
        self._first = True  # nothing of this subscription started yet: it goes ahead in the pool
        while True:
            try:
                item = self.inbox.get(timeout=_LOOK)
            except queue.Empty:
                item = None
            now = time.monotonic()
            starts: list[tuple[Hashable, Delivery]] = []
            was_in_flight = in_flight
            if item is None or item is _WAKE:
                pass
            elif item is STOP:
                halted = True
            elif isinstance(item, tuple) and item[0] is END:
                ending = item[1]
            elif isinstance(item, _Done):
                in_flight -= 1
                halted = halted or not item.go_on
                following = keys.done(item.key)
                if following is not None:  # the key's next delivery has the same key
                    starts.append((item.key, following))
            else:
                held.behind.append(item)
            if halted:
                for waiting in [*keys.take_waiting(), *held.take()]:
                    self._give_back(waiting)
                for key, start in starts:
                    keys.done(key)  # it never runs: its key is free again
                    self._give_back(start)
            else:
                go_on, in_flight = self._admit(keys, held, starts, in_flight, now)
                halted = not go_on
            if in_flight != was_in_flight:
                self._show_in_flight(in_flight)
            if in_flight:  # the stall detector's view: waiting only with nothing in a handler
                self.waiting_since = None
            elif self.waiting_since is None:
                self.waiting_since = now
            if now >= next_look:
                self.waiting = keys.longest_waiting(now)
                next_look = now + _LOOK
            if in_flight == 0 and (halted or (ending is not None and held.empty)):
                if not halted:
                    self.broker.finish(self.partition, ending)
                return

    def _admit(
        self,
        keys: KeyQueues[Delivery],
        held: _Held,
        starts: list[tuple[Hashable, Delivery]],
        in_flight: int,
        now: float,
    ) -> tuple[bool, int]:
        """Start what may start: ``starts``, gated keys whose gate opened, and what arrived,
        in order, up to a fence (run here once nothing of the partition is in a handler or
        gated). (False, n) once the fence's handling says stop; n: in flight now."""
        gate = self.resize
        while True:
            for key, start in starts:
                in_flight += 1
                self.pool.submit(functools.partial(self._run_one, start, key), first=self._first)
                self._first = False
            starts = []
            if gate is not None and held.gated:
                starts += held.opened(gate, keys, now)
            while held.behind and held.fence is None:
                delivery = held.behind.popleft()
                if is_fence(delivery):
                    held.fence = delivery
                    break
                key = key_of(delivery)
                if held.gates(gate, key, delivery):
                    continue
                ready = keys.arrive(key, delivery, now)
                if ready is not None:
                    starts.append((key, ready))
            if starts:
                continue
            if held.fence is None or in_flight or held.gated:
                return True, in_flight
            fence = held.fence
            held.fence = None
            if not self._process(fence):  # every earlier message is done: the fence's turn
                return False, in_flight

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
            with logs.bind(stream=self.spec.scope, member=self.member, partition=self.partition):
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

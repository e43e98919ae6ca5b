"""The confirm ledger: every publish from the moment it is queued until its future settles.

It keeps the bounded window (``outstanding`` of at most ``window``), the outbox of messages
not yet sent, the sent ones by delivery tag (``unconfirmed``), those the broker returned
because a resize cut their layout (``returned``; ``held`` while they wait for a newer one),
and it settles futures: with a :class:`Receipt` on a confirm, else with the error of a
nack, a return, a refusal, a lost connection or a close.

Threads. ``lock`` guards every field but ``window`` and ``on_settled`` (set once);
``space`` and ``idle``, conditions on it, block publishers on a full window and ``flush``
until nothing is outstanding.

- Callers of ``publish``/``publish_many`` (any thread) queue through :meth:`admit` and
  :meth:`admit_some`, which wait for room; ``flush`` waits in :meth:`wait_idle`; ``close``
  calls :meth:`close`, then :meth:`fail_all` once the I/O thread is gone.
- The I/O thread (``partq.producer.connection_loop``) tags the outbox with
  :meth:`take_outbox`, settles confirm frames (:meth:`settle_frame`), marks returns
  (:meth:`mark_returned`), fails what the broker refuses (:meth:`refuse`) and, after a
  connection ends, puts what was sent back in front of the outbox (:meth:`requeue_sent`).
  It also sets ``wake_scheduled`` and ``tag``, and the rerouting (``partq.producer.reroute``)
  empties ``returned`` and clears ``held``, under the lock.

Futures are settled outside the lock, on the thread that settles them (mostly the I/O
thread, once per confirm frame; a caller's for a body already known too large or a batch
cut short by a close; the closing thread for what ``close`` fails), and ``on_settled`` is
told there. ``closing`` and ``crashed`` are read without the lock (one value each). After a
confirm frame the I/O thread also reads ``held``, ``wire_epoch``, ``returned`` and whether
``unconfirmed`` and ``outbox`` are empty without it: it alone adds to ``unconfirmed`` and
``returned``, and a message a caller queues meanwhile brings its own wake-up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pika.spec
from partq.producer import metrics
from partq.producer.futures import PublishFuture, resolve_all
from partq.producer.wire import body_refused

from partq.kernel.errors import (
    ConnectionLost,
    MessageNacked,
    MessageUnroutable,
    ProducerClosed,
    PublishFailed,
)

__all__ = ["Failure", "Ledger", "Pending", "Receipt"]

log = logging.getLogger("partq.producer")

_FAILED_REASONS: dict[type[Exception], str] = {  # the reason label of metrics.FAILED
    MessageNacked: "nacked",
    MessageUnroutable: "unroutable",
    ConnectionLost: "connection",
    PublishFailed: "refused",
}


@dataclass(frozen=True, slots=True)
class Receipt:
    """What a confirmed publish resolves to."""

    message_id: str
    partition: int


@dataclass(slots=True)
class Pending:
    partition: int
    body: bytes
    properties: bytes  # the content header's properties, encoded
    message_id: str
    future: PublishFuture[Receipt]
    # what a republish under a newer layout encodes again (the partition header changes)
    key: str | bytes
    headers: Mapping[str, Any] | None
    now: float  # its partq-published-ms and timestamp, kept across a republish
    epoch: int  # of the layout it was routed under
    routing_key: str
    published_at: float = 0.0
    returned: bool = False


Failure = tuple[Pending, PublishFailed | ProducerClosed]


class Ledger:
    """The outstanding publishes of one producer, and its window (see the module)."""

    def __init__(
        self,
        stream: str,
        window: int,
        epoch: int,
        on_settled: Callable[[Sequence[PublishFuture[Receipt]]], None] | None,
    ) -> None:
        self.window = window
        self.on_settled = on_settled
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)  # nothing outstanding
        self.space = threading.Condition(self.lock)  # fewer than window outstanding
        self.outbox: deque[Pending] = deque()
        self.unconfirmed: dict[int, Pending] = {}
        # Returned by the broker (their layout was cut), by delivery tag: republished in
        # order under a newer layout once every message sent before or with them is
        # settled. ``held``: one was returned, nothing new goes out meanwhile.
        self.returned: dict[int, Pending] = {}
        self.held = False
        self.outstanding = 0
        self.tag = 0  # the channel's last delivery tag
        self.wake_scheduled = False  # a drain of the outbox is scheduled on the I/O thread
        self.wire_epoch = epoch  # of the messages in unconfirmed (all of one epoch)
        self.closing = False
        self.crashed: BaseException | None = None  # what ended the I/O thread, if it failed
        self._labels = (stream,)
        # labelled children looked up once: .labels() costs a lock and a dict per call
        self._m_confirmed = metrics.CONFIRMED.labels(stream)
        self._m_confirm_seconds = metrics.CONFIRM_SECONDS.labels(stream)
        self.m_in_flight = metrics.IN_FLIGHT.labels(stream)

    # -- the callers' side: the window ------------------------------------------------------

    def admit(self, pending: Pending) -> bool:
        """Queue one message once the window has room: whether to wake the I/O thread.
        Raises :class:`ProducerClosed` once closing."""
        with self.lock:  # one lock per message: the window is counted under it too
            self._wait_for_room()
            self.outbox.append(pending)
            self.outstanding += 1
            return not self.wake_scheduled

    def admit_some(self, batch: list[Pending], start: int) -> tuple[int, bool]:
        """Queue what of ``batch[start:]`` the window has room for, once it has some: how
        many, and whether to wake the I/O thread. Raises :class:`ProducerClosed` once
        closing."""
        with self.lock:
            self._wait_for_room()
            take = min(len(batch) - start, self.window - self.outstanding)
            self.outbox.extend(batch[start : start + take])
            self.outstanding += take
            return take, not self.wake_scheduled

    def _wait_for_room(self) -> None:
        """Under the lock: wait while the window is full; refuse once closing."""
        while self.outstanding >= self.window and not self.closing:
            self.space.wait()
        if self.closing:
            raise self.closed_error()

    def wait_idle(self, timeout: float | None) -> None:
        """Wait until every message queued so far is confirmed or failed."""
        with self.idle:
            if not self.idle.wait_for(lambda: self.outstanding == 0, timeout):
                raise TimeoutError(
                    f"{self.outstanding} messages still unconfirmed after {timeout}s"
                )

    def close(self) -> None:
        """Refuse new messages; publishers blocked on a full window get ProducerClosed."""
        with self.lock:
            self.closing = True
            self.space.notify_all()

    def closed_error(self) -> ProducerClosed:
        crashed = self.crashed
        if crashed is None:
            return ProducerClosed("the producer is closed: create a new one")
        error = ProducerClosed(
            f"the producer's I/O thread failed ({crashed!r}), so the producer is closed and "
            f"the message was not confirmed: create a new producer"
        )
        error.__cause__ = crashed
        return error

    def refuse_unsent(self, refused: list[Pending], limit: int) -> None:
        """Bodies above the broker's max_message_size (it refused one): fail, never sent."""
        metrics.FAILED.labels(*self._labels, "refused").inc(len(refused))
        for pending in refused:
            pending.future.set_exception(body_refused(len(pending.body), limit))
        self.settled([pending.future for pending in refused])

    def settled(self, futures: Sequence[PublishFuture[Receipt]]) -> None:
        """Tell ``on_settled`` (a bridge such as AsyncProducer) which futures just settled."""
        if self.on_settled is not None and futures:
            self.on_settled(futures)

    # -- the I/O thread's side: tags, confirms, returns ---------------------------------------

    def take_outbox(self, epoch: int) -> list[Pending] | None:
        """Under the lock, about to send under a layout of ``epoch``: the outbox, each
        message tagged in ``unconfirmed``; None while nothing may go out."""
        # Nothing goes out while returned messages wait for a newer layout, nor under a
        # newer epoch while messages of the older one may still be returned: a key's
        # later message must not be routed before its earlier one is republished.
        if self.held or (self.unconfirmed and self.wire_epoch != epoch):
            return None
        self.wire_epoch = epoch
        batch = list(self.outbox)
        self.outbox.clear()
        self.m_in_flight.set(self.outstanding)
        # Tagged before publishing: one lock for the batch, and a publish cut short
        # by a lost channel is already in unconfirmed, so it is republished.
        tag = self.tag
        unconfirmed = self.unconfirmed
        for pending in batch:
            tag += 1
            unconfirmed[tag] = pending
        self.tag = tag
        return batch

    def requeue_sent(self) -> None:
        """Under the lock, once a connection ended: unconfirmed and returned messages go
        back to the front, in publish order (sent again, the returned ones are rerouted if
        a newer layout is known)."""
        requeue = self.in_order()
        self.unconfirmed.clear()
        self.returned.clear()
        self.held = False
        self.outbox.extendleft(reversed(requeue))

    def in_order(self) -> list[Pending]:
        """Unconfirmed and returned messages, in the order they were sent (under the lock)."""
        sent = {**self.unconfirmed, **self.returned}
        return [sent[tag] for tag in sorted(sent)]

    def mark_returned(self, message_id: str | None) -> None:
        """A mandatory message that no queue took comes back before its ack."""
        with self.lock:
            for pending in self.unconfirmed.values():
                if not pending.returned and pending.message_id == message_id:
                    pending.returned = True
                    break

    def settle_frame(
        self,
        method: pika.spec.Basic.Ack | pika.spec.Basic.Nack,
        follows: bool,
        unroutable: Callable[[Pending], MessageUnroutable],
    ) -> tuple[bool, list[Pending]]:
        """Settle a confirm frame's messages in one go: whether messages were held for a
        newer layout before it, and those it returned (``follows``: kept for a newer
        layout; else failed with ``unroutable``)."""
        nacked = isinstance(method, pika.spec.Basic.Nack)
        with self.lock:
            if method.multiple:
                tags = []
                for tag in self.unconfirmed:  # ascending: tags are inserted in order
                    if tag > method.delivery_tag:
                        break
                    tags.append(tag)
            else:
                tags = [method.delivery_tag] if method.delivery_tag in self.unconfirmed else []
            done = [self.unconfirmed.pop(tag) for tag in tags]
        held = self.held
        confirmed: list[Pending] = []
        failed: list[Failure] = []
        returned: list[Pending] = []
        for tag, pending in zip(tags, done, strict=True):
            if nacked:
                failed.append((pending, MessageNacked("the broker refused the message (nack)")))
            elif pending.returned and follows:
                pending.returned = False
                returned.append(pending)
                with self.lock:  # republished once a newer layout is known
                    self.returned[tag] = pending
                    self.held = True
            elif pending.returned:
                failed.append((pending, unroutable(pending)))
            else:
                confirmed.append(pending)
        self.resolve(confirmed, failed)  # all at once: one lock and one window release
        return held, returned

    def take_returned(self) -> list[Pending]:
        """Under the lock: the returned messages in their first order, no longer held."""
        again = [self.returned[tag] for tag in sorted(self.returned)]
        self.returned.clear()
        self.held = False
        return again

    # -- settling (the I/O thread, or the closing thread once the I/O thread is gone) --------

    def resolve(self, confirmed: list[Pending], failed: list[Failure] | None = None) -> None:
        """Settle each message's future, then open the window by as many (one lock, not N)."""
        settled = len(confirmed)
        if confirmed:
            now = time.monotonic()
            # A drained batch shares its published_at: one histogram update per run of them.
            metrics.observe_runs(
                self._m_confirm_seconds, now, [pending.published_at for pending in confirmed]
            )
            resolve_all(
                [
                    (pending.future, Receipt(pending.message_id, pending.partition))
                    for pending in confirmed
                ]
            )
            self._m_confirmed.inc(settled)
        for pending, error in failed or ():
            settled += 1
            reason = _FAILED_REASONS.get(type(error), "closed")
            metrics.FAILED.labels(*self._labels, reason).inc()
            pending.future.set_exception(error)
        if not settled:
            return
        with self.lock:
            self.outstanding -= settled
            self.m_in_flight.set(self.outstanding)  # here and per batch sent: not per message
            self.space.notify(settled)
            if self.outstanding == 0:
                self.idle.notify_all()
        if self.on_settled is not None:  # after the window opened: the bridge may refill it
            self.settled([p.future for p in confirmed] + [p.future for p, _ in failed or ()])

    def fail_all(self, error: PublishFailed | ProducerClosed) -> None:
        with self.lock:
            doomed = [*self.in_order(), *self.outbox]
            self.unconfirmed.clear()
            self.returned.clear()
            self.outbox.clear()
            self.held = False
        self.resolve([], [(pending, error) for pending in doomed])

    def refuse(
        self, refused: Callable[[Pending], bool], error: Callable[[Pending], PublishFailed]
    ) -> None:
        """Fail the messages the broker will never take, so that no reconnect sends them again.

        The others stay where they are: unconfirmed ones are republished in order.
        """
        with self.lock:
            tags = [tag for tag, pending in self.unconfirmed.items() if refused(pending)]
            doomed = [self.unconfirmed.pop(tag) for tag in tags]
            if any(refused(pending) for pending in self.outbox):
                kept = [pending for pending in self.outbox if not refused(pending)]
                doomed += [pending for pending in self.outbox if refused(pending)]
                self.outbox.clear()
                self.outbox.extend(kept)
        outcomes: list[Failure] = [(pending, error(pending)) for pending in doomed]
        if outcomes:
            log.warning("%d message(s) failed: %s", len(outcomes), outcomes[0][1])
        self.resolve([], outcomes)

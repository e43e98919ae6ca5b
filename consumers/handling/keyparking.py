"""What a worker does for a stream that parks failing keys (``on_failure = park``).

A message of a parked key is parked behind its key's earlier ones instead of handled; a
message whose handler attempts all failed parks its key; a control message of ``partq
dlq`` (``redrive`` or ``purge``, checked by :mod:`partq.consumers.control.redrive`) replays or drops
the key's parked messages, the replay going through the worker's own handler attempts.

A replay hands the handler only what partq parked for that key. Whoever may publish to the
exchanges a parking queue is bound to (any consumer's user: docs/security.md) can put other
messages in it: a control message, a resize's fence, a drain's filler, another key's or a
keyless message. The replay dead-letters those unhandled (:class:`ForeignParked`, counted as
``partq_consumer_header_problems_total{problem="foreign_parked"}``) and goes on.

:class:`KeyParking` is a base class of :class:`partq.consumers.handling.worker.Worker`: its methods
run
on whichever thread handles the message (the worker's thread, or a pool thread of
``partq.consumers.handling.keyed``), and wait on ``stopped`` between retries, as the worker does.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import threading
from collections.abc import Mapping
from typing import Any

from partq.consumers import metrics
from partq.consumers.broker.port import Delivery
from partq.consumers.control import redrive as control
from partq.consumers.handling.message import MalformedHeaders, Message
from partq.consumers.handling.parking import Parking, shown_key
from partq.coordinator.store.session import Session
from partq.producer.contract import (
    CONTROL_FENCE,
    CONTROL_FILL,
    HEADER_CONTROL,
    StreamSpec,
    key_bytes,
    key_id,
)

from partq.kernel.backoff import Backoff
from partq.kernel.errors import PartqError

__all__ = ["RETRY_BACKOFF", "ForeignParked", "KeyParking", "Outcome", "foreign"]

log = logging.getLogger("partq.consumer.worker")
RETRY_BACKOFF = Backoff()  # between parking or dead-lettering attempts: 0.2 s doubling to 5 s


class Outcome(enum.Enum):
    """What became of one delivery."""

    ACK = "ack"
    KEEP = "keep"  # stopped before the end: not acked, the broker redelivers it
    TIMED_OUT = "timed-out"  # the watchdog dead-lettered and acked it: stop here


class ForeignParked(PartqError):
    """A message in a key's parking queue that is not one of the key's parked messages
    (the dead letter's error type): a redrive never hands it to the handler."""


_CONTROLS = {CONTROL_FENCE: "a resize's fence", CONTROL_FILL: "a drain's filler"}


def foreign(headers: Mapping[str, Any], key: str | bytes | None, parked: str | bytes) -> str | None:
    """Why a message with ``headers`` and ``key`` (as the handler would see it) found in
    ``parked``'s parking queue is not one of that key's parked messages, or None if it is.
    Pure: a parked message is a producer's message of that very key, and nothing partq
    sends itself (``x-partq-control``) is ever parked."""
    control = headers.get(HEADER_CONTROL)
    if control is not None:
        text = control.decode(errors="replace") if isinstance(control, bytes) else str(control)
        return _CONTROLS.get(text, f"a control message ({HEADER_CONTROL}: {text[:40]!r})")
    if key is None:
        return "a message without a partq key"
    if key_bytes(key) != key_bytes(parked):
        return f"a message of key {shown_key(key)}"
    return None


@dataclasses.dataclass(slots=True)
class _Replay:
    """What the last parked message of one redrive came to (one redrive, one thread)."""

    key: str | bytes  # the key redriven
    timed_out: bool = False
    failure: BaseException | None = None


class KeyParking:
    """Parking and redrive steps of a worker (the module docstring); the worker provides
    the attributes and the handler attempts declared here."""

    spec: StreamSpec
    partition: int
    session: Session
    parking: Parking | None
    stopped: threading.Event
    _labels: tuple[str, str]

    def _message(self, delivery: Delivery) -> Message:
        raise NotImplementedError

    def _attempts(
        self, delivery: Delivery, message: Message, *, replay: bool = False
    ) -> tuple[Outcome, BaseException | None, int]:
        raise NotImplementedError

    def _dead_letter(
        self, delivery: Delivery, error: BaseException, attempts: int, patience: float | None = None
    ) -> Outcome:
        raise NotImplementedError

    def _park(
        self, delivery: Delivery, key: str | bytes, error: BaseException | None, attempts: int
    ) -> Outcome:
        """ACK once the message is in its key's parking queue; KEEP if stopped first."""
        assert self.parking is not None
        stalls = self.parking.stalls  # logs, counts and reports a failing park
        delays = RETRY_BACKOFF.delays()
        while not self.stopped.is_set():
            try:
                self.parking.park(delivery, key, error, attempts, self.session)
            except Exception as e:  # etcd or broker trouble: keep the message, try again
                stalls.failed(self.partition, key, e)
                self.stopped.wait(delays.next())
                continue
            stalls.ended(self.partition, parked=True)
            metrics.HANDLED.labels(*self._labels, "parked").inc()
            metrics.PARKED.labels(*self._labels).inc()
            if error is not None:
                log.error(
                    "partition %d: message %s failed %d handler attempts (%r): key %s parked; "
                    "its messages wait until `partq dlq redrive %s`",
                    self.partition,
                    delivery.properties.message_id,
                    attempts,
                    error,
                    shown_key(key),
                    self.spec.scope,
                )
            return Outcome.ACK
        stalls.ended(self.partition, parked=False)
        return Outcome.KEEP

    def _control(self, delivery: Delivery, message: Message, action: Any) -> Outcome:
        """A redrive or purge request of ``partq dlq`` for the message's key; dead-lettered
        unobeyed unless the stream's operator or admin sent it
        (:mod:`partq.consumers.control.redrive`)."""
        key, parking = message.key, self.parking
        if parking is not None:
            try:
                control.verify(action, delivery.properties.user_id, parking.senders)
            except control.ForgedControl as forged:
                metrics.HEADER_PROBLEMS.labels(*self._labels, "forged_control").inc()
                log.error("partition %d: %s: dead-lettering it", self.partition, forged)
                return self._dead_letter(delivery, forged, 0)
        if (
            key is None
            or parking is None
            or action not in ("redrive", b"redrive", "purge", b"purge")
        ):
            log.warning(
                "partition %d: ignoring control message %r for key %s (stream parks: %s)",
                self.partition,
                action,
                shown_key(key),
                parking is not None,
            )
            return Outcome.ACK
        if parking.parked.get(key_id(key)) is None:
            log.info(
                "partition %d: key %s is not parked: nothing to %s",
                self.partition,
                shown_key(key),
                action,
            )
            return Outcome.ACK
        purge = action in ("purge", b"purge")
        delays = RETRY_BACKOFF.delays()
        while not self.stopped.is_set():
            try:
                if purge:
                    parking.purge(key)
                    log.warning(
                        "partition %d: key %s purged: its parked messages are gone",
                        self.partition,
                        shown_key(key),
                    )
                    return Outcome.ACK
                replay = _Replay(key)
                one = functools.partial(self._replay_one, replay=replay)
                if parking.replay(self.partition, key, one, self.stopped):
                    metrics.REDRIVES.labels(*self._labels).inc()
                    log.info(
                        "partition %d: key %s redriven and unparked", self.partition, shown_key(key)
                    )
                    return Outcome.ACK
                if replay.timed_out:
                    return Outcome.TIMED_OUT
                if self.stopped.is_set():
                    return Outcome.KEEP
                log.error(
                    "partition %d: a parked message of key %s failed again: the key stays parked",
                    self.partition,
                    shown_key(key),
                )
                self._report_redrive_failed(parking, key, delivery, replay.failure)
                return Outcome.ACK
            except Exception as e:  # etcd or broker trouble: keep the request, try again
                log.warning(
                    "partition %d: %s of key %s failed: %s",
                    self.partition,
                    action,
                    shown_key(key),
                    e,
                )
                self.stopped.wait(delays.next())
        return Outcome.KEEP

    def _replay_one(self, delivery: Delivery, replay: _Replay) -> bool:
        """Handle one parked message during a redrive: True once handled (or, if it is not
        one of the key's, dead-lettered)."""
        headers = delivery.properties.headers or {}
        try:
            message = self._message(delivery)
            why = foreign(headers, message.key, replay.key)
        except MalformedHeaders as e:
            why = f"a message with malformed partq headers ({e})"
        if why is not None:
            return self._drop_foreign(delivery, replay.key, why)
        outcome, failure, _count = self._attempts(delivery, message, replay=True)
        replay.timed_out = outcome is Outcome.TIMED_OUT
        replay.failure = failure
        return outcome is Outcome.ACK

    def _drop_foreign(self, delivery: Delivery, key: str | bytes, why: str) -> bool:
        """Dead-letter a message that is not one of ``key``'s parked ones, unhandled: True
        once it is (the replay acks it and goes on), False if stopped first."""
        metrics.HEADER_PROBLEMS.labels(*self._labels, "foreign_parked").inc()
        error = ForeignParked(
            f"{why} in the parking queue of key {shown_key(key)}: partq never parks it "
            f"there, so a redrive does not hand it to the handler"
        )
        log.error("partition %d: %s: dead-lettering it", self.partition, error)
        return self._dead_letter(delivery, error, 0) is Outcome.ACK

    def _report_redrive_failed(
        self,
        parking: Parking,
        key: str | bytes,
        request: Delivery,
        failure: BaseException | None,
    ) -> None:
        """Best effort: without the report, the waiting command times out instead."""
        try:
            parking.report_redrive_failed(key, str(request.properties.message_id or ""), failure)
        except Exception as e:
            log.warning("partition %d: reporting the failed redrive failed: %s", self.partition, e)

"""What a worker does about a resize (docs/resize.md): gated messages and fences.

A message of the new layout whose key moved waits, holding the partition, until the key's
old partition handled its fence (``_gate``, asking the member's
:class:`partq.consumers.control.resizing.ResizeGate`). A fence (``x-partq-control:
fence``) is never handed to the handler: every message before it was handled, so the
partition's old layout is drained; that is recorded in etcd (retried while etcd is away),
then the fence is acked (``_fence``). One whose routing key or epoch is not a resize's is
dead-lettered as forged (:class:`ForgedFence`).

:class:`ResizeSteps` is a base class of :class:`partq.consumers.handling.worker.Worker`:
its methods run on whichever thread handles the message (the worker's thread, or a pool
thread of ``partq.consumers.handling.keyed``) and wait on ``stopped``, as the worker does;
the gate is the member's, shared by its workers (thread-safe).
"""

from __future__ import annotations

import logging
import threading

from partq.consumers import metrics
from partq.consumers.broker.port import Delivery
from partq.consumers.control.resizing import WAITING_FOR_RECORD, ResizeGate
from partq.consumers.handling import keyparking
from partq.consumers.handling.keyparking import Outcome
from partq.coordinator.store.session import Session
from partq.producer.contract import (
    CONTROL_FENCE,
    HEADER_CONTROL,
    HEADER_EPOCH,
    HEADER_SEAL,
    decode_key,
    fence_routing_key,
    is_seal,
)

from partq.kernel.errors import EtcdError, PartqError

__all__ = ["ForgedFence", "ResizeSteps", "is_fence"]

log = logging.getLogger("partq.consumer.worker")


class ForgedFence(PartqError):
    """A fence whose routing key or epoch is not what a resize publishes (dead-lettered)."""


def is_fence(delivery: Delivery) -> bool:
    """Whether ``delivery`` is a resize's fence (partq's control header says so)."""
    headers = delivery.properties.headers
    return bool(headers) and headers.get(HEADER_CONTROL) in (CONTROL_FENCE, CONTROL_FENCE.encode())


class ResizeSteps:
    """A worker's resize steps (the module docstring); the worker provides the attributes
    and the dead-lettering declared here."""

    partition: int
    session: Session
    resize: ResizeGate | None
    stopped: threading.Event
    _labels: tuple[str, str]

    def _dead_letter(
        self, delivery: Delivery, error: BaseException, attempts: int, patience: float | None = None
    ) -> Outcome:
        raise NotImplementedError

    def _gate(self, delivery: Delivery) -> bool:
        """Wait while ``delivery`` is gated by a resize; False if it must be given back."""
        gate = self.resize
        if gate is None:
            return True
        try:
            key = decode_key(delivery.properties.headers or {})
        except Exception:  # malformed: dead-lettered in its turn, never gated
            key = None
        waits_for = gate.waits_for(delivery.routing_key, key)
        if waits_for is None:
            return True
        log.info(
            "partition %d: a message of layout %s waits for %s",
            self.partition,
            delivery.routing_key,
            "the resize's record"
            if waits_for == WAITING_FOR_RECORD
            else f"old partition {waits_for} to handle its fence",
        )
        return gate.wait(
            delivery.routing_key,
            key,
            lambda: (
                self.stopped.is_set() or not delivery.channel.is_open or self.session.lost.is_set()
            ),
        )

    def _fence(self, delivery: Delivery) -> Outcome:
        """A resize's fence: every message before it is handled, so the old layout of this
        partition is drained. Recorded in etcd (retried while it is away), then acked."""
        raw = (delivery.properties.headers or {}).get(HEADER_EPOCH)
        epoch = raw if type(raw) is int and raw >= 0 else None
        if epoch is None or delivery.routing_key != fence_routing_key(epoch, self.partition):
            forged = ForgedFence(
                f"a fence on routing key {delivery.routing_key!r} with epoch {raw!r}: a "
                f"resize fences partition {self.partition} on 'fence.<epoch>.{self.partition}'"
            )
            metrics.HEADER_PROBLEMS.labels(*self._labels, "forged_control").inc()
            log.error("partition %d: %s: dead-lettering it", self.partition, forged)
            return self._dead_letter(delivery, forged, 0)
        seal = (delivery.properties.headers or {}).get(HEADER_SEAL, "")
        seal = seal.decode(errors="replace") if isinstance(seal, bytes) else str(seal)
        if not is_seal(seal):  # none (an older partq's resize) or not one we make:
            seal = ""  # recorded without, believed only by a resize that sealed no fence
        gate = self.resize
        delays = keyparking.RETRY_BACKOFF.delays()
        while gate is not None and not self.stopped.is_set():
            try:
                gate.drained(epoch, self.partition, seal)
                break
            except EtcdError as e:
                log.warning("partition %d: cannot record its fence yet: %s", self.partition, e)
                self.stopped.wait(delays.next())
        else:
            if gate is not None:
                return Outcome.KEEP  # stopped: the fence is handled again by the next owner
            log.error("partition %d: a fence of epoch %d, unrecorded", self.partition, epoch)
        log.info(
            "partition %d: handled the fence of layout epoch %d: its old layout is drained",
            self.partition,
            epoch,
        )
        return Outcome.ACK

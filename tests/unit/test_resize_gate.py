"""A consumer's side of a resize with fakes around it (etcd: ``FakeEtcd``): the gate opens
when the key's old partition records its fence, old-layout messages never wait, and with
``--concurrency`` a fence waits for every message before it and holds every one after."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pika
import pytest
from partq.consumers.broker.port import END, Delivery
from partq.consumers.control.resizing import WAITING_FOR_RECORD, ResizeGate
from partq.consumers.handling.keyed import KeyedWorker
from partq.consumers.handling.message import Message
from partq.consumers.handling.runners import HandlerPool
from partq.coordinator.leader import resize
from partq.coordinator.store import codec
from partq.producer.contract import (
    CONTROL_FENCE,
    HEADER_CONTROL,
    HEADER_EPOCH,
    HEADER_SEAL,
    fence_routing_key,
    seal_digest,
)
from partq.producer.layout import Layout
from prometheus_client import REGISTRY

from partq.kernel import keys
from tests.fakes.etcd import FakeEtcd
from tests.polling import wait_until
from tests.unit.test_keyed import _worker as keyed_worker
from tests.unit.test_worker import PARTITION, SPEC, Broker, Channel, DeadLetters

GROW = Layout(6).resize(12)
SEAL = "5e" * 16  # every old partition's fence's (what `partq stream resize` publishes)
SEALS = frozenset((p, seal_digest(SEAL)) for p in range(6))
MOVED = next(f"k{i}" for i in range(1000) if GROW.gate(f"k{i}") is not None)
STAYS = next(f"k{i}" for i in range(1000) if GROW.gate(f"k{i}") is None)


@pytest.fixture
def etcd() -> FakeEtcd:
    return FakeEtcd()


@pytest.fixture
def gate(etcd: FakeEtcd) -> Iterator[ResizeGate]:
    made = ResizeGate(etcd, "fake", SPEC.name, "m1", 0)
    made.start()
    yield made
    made.close()


def _switched(etcd: FakeEtcd, seals: frozenset[tuple[int, str]] | None = SEALS) -> None:
    state = resize.State(GROW, resize.Phase.SWITCHED, seals=seals)
    etcd.put(keys.resize(SPEC.name), resize.encode(state))


def test_old_layout_never_waits_and_a_newer_one_waits_for_its_record(
    etcd: FakeEtcd, gate: ResizeGate
) -> None:
    assert gate.waits_for("3", MOVED) is None
    assert gate.waits_for("1.3", STAYS) == WAITING_FOR_RECORD  # no resize read yet
    _switched(etcd)
    assert gate.waits_for("1.3", STAYS) is None
    assert gate.waits_for("3", MOVED) is None
    assert gate.waits_for("fence.0.3", MOVED) is None  # a fence is no layout's message


def test_a_moved_key_waits_for_its_old_partitions_fence(etcd: FakeEtcd, gate: ResizeGate) -> None:
    _switched(etcd)
    old = GROW.gate(MOVED)
    assert gate.waits_for("1.7", MOVED) == old
    opened = threading.Event()

    def wait() -> None:
        if gate.wait("1.7", MOVED, lambda: False):
            opened.set()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    assert not opened.wait(0.2)
    # When another member records the old partition's fence
    other = ResizeGate(etcd, "fake", SPEC.name, "m2", 0)
    assert old is not None
    other.drained(0, old, SEAL)
    # Then the gate opens here, pushed by the watch
    assert opened.wait(5)
    assert gate.waits_for("1.7", MOVED) is None
    raw, _meta = etcd.get(keys.drained(SPEC.name, 0, old))
    assert raw is not None and b"m2" in raw


def test_a_drained_key_named_otherwise_than_partq_names_it_opens_no_gate(
    etcd: FakeEtcd, gate: ResizeGate
) -> None:
    # Given a switched grow whose moved key waits for its old partition's fence
    _switched(etcd)
    old = GROW.gate(MOVED)
    assert old is not None
    # When drained keys for that partition appear under names partq does not write (the
    # partition not in 5 digits; the epoch with a leading zero)
    etcd.put(f"{keys.drained_all(SPEC.name)}0/{old}", codec.encode_drained("m2", SEAL))
    etcd.put(f"{keys.drained_all(SPEC.name)}00/{old:05d}", codec.encode_drained("m2", SEAL))
    # Then they record no fence: the key still waits
    assert gate.waits_for("1.7", MOVED) == old
    # And the key as partq names it (keys.drained) opens the gate
    etcd.put(keys.drained(SPEC.name, 0, old), codec.encode_drained("m2", SEAL))
    assert gate.waits_for("1.7", MOVED) is None


def test_a_drained_key_without_its_fences_seal_opens_no_gate_and_is_counted(
    etcd: FakeEtcd, gate: ResizeGate
) -> None:
    # Given a switched grow whose moved key waits for its old partition's fence
    _switched(etcd)
    old = GROW.gate(MOVED)
    assert old is not None
    before = _malformed("drained")
    # When a consumer's credentials write the drained key with a seal of their own, or
    # another partition's (etcd shows only digests: they cannot know the fence's)
    etcd.put(keys.drained(SPEC.name, 0, old), codec.encode_drained("m2", "0" * 32))
    # Then it records no fence: the key still waits, and the record is counted once
    assert gate.waits_for("1.7", MOVED) == old
    assert gate.waits_for("1.7", MOVED) == old
    assert _malformed("drained") == before + 1
    # And the record of whoever handled the fence opens it
    etcd.put(keys.drained(SPEC.name, 0, old), codec.encode_drained("m2", SEAL))
    assert gate.waits_for("1.7", MOVED) is None


def test_a_resize_recorded_without_seals_believes_its_drained_keys(
    etcd: FakeEtcd, gate: ResizeGate
) -> None:
    # Given a resize whose record an older partq wrote (no seals in it)
    _switched(etcd, seals=None)
    old = GROW.gate(MOVED)
    assert old is not None
    raw, _meta = etcd.get(keys.resize(SPEC.name))
    assert raw is not None and b"seals" not in raw
    # When its drained key is written with any seal, the gate opens
    etcd.put(keys.drained(SPEC.name, 0, old), codec.encode_drained("m2", "0" * 32))
    assert gate.waits_for("1.7", MOVED) is None


def _malformed(kind: str) -> float:
    value = REGISTRY.get_sample_value(
        "partq_etcd_malformed_values_total", {"stream": SPEC.name, "kind": kind}
    )
    return value or 0.0


def _worker(handler: object, pool: HandlerPool, broker: Broker, gate: ResizeGate) -> KeyedWorker:
    return keyed_worker(handler, pool, broker, DeadLetters(), resize=gate)


def _delivery(tag: int, key: str, routing_key: str) -> Delivery:
    headers = {"partq-key": key, "partq-partition": PARTITION, "partq-published-ms": 1}
    props = pika.BasicProperties(message_id=f"{key}-{tag}", headers=headers)
    return Delivery(PARTITION, Channel(), tag, False, props, b"x", 0, routing_key)


def _fence(tag: int, epoch: int = 0, seal: str | None = SEAL) -> Delivery:
    headers: dict[str, object] = {HEADER_CONTROL: CONTROL_FENCE, HEADER_EPOCH: epoch}
    if seal is not None:
        headers[HEADER_SEAL] = seal
    props = pika.BasicProperties(headers=headers)
    routing_key = fence_routing_key(epoch, PARTITION)
    return Delivery(PARTITION, Channel(), tag, False, props, b"", 0, routing_key)


class Calls:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, float, float]] = []  # message id, start, end

    def handler(self, message: Message) -> None:
        start = time.monotonic()
        time.sleep(0.1 if message.key == "slow" else 0.001)
        with self.lock:
            self.spans.append((str(message.message_id), start, time.monotonic()))

    def span(self, message_id: str) -> tuple[float, float]:
        with self.lock:
            return next((s, e) for m, s, e in self.spans if m == message_id)


def test_with_concurrency_a_fence_waits_for_what_is_in_flight_and_holds_what_follows(
    etcd: FakeEtcd, gate: ResizeGate
) -> None:
    calls, pool, broker = Calls(), HandlerPool(8), Broker()
    fenced: list[float] = []
    etcd_put = etcd.put

    def put(key: str, value: str, lease: object = None) -> object:
        if "/drained/" in str(key):
            fenced.append(time.monotonic())
        return etcd_put(key, value, lease)

    etcd.put = put  # type: ignore[method-assign,assignment]
    worker = _worker(calls.handler, pool, broker, gate)
    # When a slow message, the fence, then a message of another key arrive
    worker.inbox.put(_delivery(1, "slow", "0"))
    worker.inbox.put(_fence(2))
    worker.inbox.put(_delivery(3, "other", "0"))
    worker.inbox.put((END, Channel()))
    assert broker.finished.wait(10)
    # Then the fence is recorded after the slow one ended, and the next starts after it;
    # the fence never reached the handler, and all three are acked
    assert len(fenced) == 1
    assert calls.span("slow-1")[1] <= fenced[0] <= calls.span("other-3")[0]
    assert len(calls.spans) == 2
    assert sorted(broker.acked) == [1, 2, 3]
    pool.close()


def test_with_concurrency_only_the_gated_key_waits(etcd: FakeEtcd, gate: ResizeGate) -> None:
    _switched(etcd)
    calls, pool, broker = Calls(), HandlerPool(8), Broker()
    worker = _worker(calls.handler, pool, broker, gate)
    # When new-layout messages of a moved key (its old partition not drained) and of a
    # key that stays arrive, the moved key's first
    worker.inbox.put(_delivery(1, MOVED, f"1.{PARTITION}"))
    worker.inbox.put(_delivery(2, STAYS, f"1.{PARTITION}"))
    worker.inbox.put(_delivery(3, MOVED, f"1.{PARTITION}"))
    # Then the key that stays is handled, the moved one not
    wait_until(lambda: len(calls.spans) == 1, 5, what="the staying key handled")
    time.sleep(0.2)
    assert [m for m, _s, _e in calls.spans] == [f"{STAYS}-2"]
    # And once its old partition records its fence, the moved key goes, in order
    old = GROW.gate(MOVED)
    assert old is not None
    ResizeGate(etcd, "fake", SPEC.name, "m2", 0).drained(0, old, SEAL)
    worker.inbox.put((END, Channel()))
    assert broker.finished.wait(10)
    assert [m for m, _s, _e in calls.spans] == [f"{STAYS}-2", f"{MOVED}-1", f"{MOVED}-3"]
    pool.close()


@pytest.mark.parametrize("seal", [None, "", "not-a-seal"])
def test_a_fence_without_a_seal_is_recorded_without_one_and_never_fails_the_worker(
    etcd: FakeEtcd, gate: ResizeGate, seal: str | None
) -> None:
    # Given a fence as an older partq's resize publishes it (no seal), or with a bad one
    calls, pool, broker = Calls(), HandlerPool(8), Broker()
    worker = _worker(calls.handler, pool, broker, gate)
    worker.inbox.put(_fence(1, seal=seal))
    worker.inbox.put((END, Channel()))
    # Then it is acked, and its drained key carries no seal (an older resize believes it;
    # a sealed one does not)
    assert broker.finished.wait(10)
    assert broker.acked == [1]
    raw, _meta = etcd.get(keys.drained(SPEC.name, 0, PARTITION))
    assert raw is not None and b"seal" not in raw
    pool.close()

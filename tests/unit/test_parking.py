"""Per-key parking, pure parts and the worker with fakes: what parks, what flows, replays."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consumers.broker import Delivery
from consumers.parking import ParkedKeys
from coordinator import codec
from coordinator.codec import Parked
from kernel.errors import MalformedValue
from producer.contract import StreamSpec, key_id, park_queue

from .test_worker import PARTITION, Run


def parked(key: str | bytes, partition: int = PARTITION) -> Parked:
    return Parked(key_id(key), partition, "ValueError: boom", "ValueError", "m1", "c1", 1.0)


@given(st.binary(min_size=1, max_size=300))
def test_a_parked_record_round_trips_for_any_key(key: bytes) -> None:
    record = parked(key)
    decoded = codec.decode("parked", "s", record.key_id, codec.encode_parked(record))
    assert decoded == record
    assert decoded.key == key


def test_text_and_bytes_keys_are_one_key_and_one_queue() -> None:
    assert key_id("k€") == key_id("k€".encode())
    assert park_queue("s", "k€") == park_queue("s", "k€".encode())
    assert park_queue("s", "a") != park_queue("s", "b")
    assert parked(b"\xff\x00").key_text == "b64:/wA="
    assert parked("orders-7").key_text == "orders-7"


def test_a_parked_key_name_must_be_base64url() -> None:
    with pytest.raises(MalformedValue):
        codec.decode("parked", "s", "not/base64", codec.encode_parked(parked("k")))


def test_an_older_spec_reads_back_unchanged_and_dead_letters() -> None:
    old = '{"name": "s", "partitions": 4, "queue_type": "quorum", "v": 1}'
    spec = StreamSpec.from_json(old)
    assert spec.on_failure == "dead-letter"
    assert spec.to_json() == old
    parking = StreamSpec("s", 4, on_failure="park")
    assert StreamSpec.from_json(parking.to_json()) == parking


def test_the_latest_revision_of_a_key_wins() -> None:
    keys = ParkedKeys()
    record = parked("k")
    keys.apply(record.key_id, record, 10)  # our own write
    keys.apply(record.key_id, None, 12)  # our own unpark
    keys.apply(record.key_id, record, 10)  # the watch's echo of the first: stale
    assert keys.get(record.key_id) is None
    keys.reset({record.key_id: record}, 11)  # a snapshot older than our unpark
    assert keys.get(record.key_id) is None
    keys.reset({record.key_id: record}, 13)  # a newer one: parked again by someone
    assert keys.get(record.key_id) == record


class FakeParking:
    """Parks into lists; replays what it holds through ``handle``."""

    def __init__(self) -> None:
        self.parked = ParkedKeys()
        self.queues: dict[str, list[Delivery]] = {}
        self.revision = 0

    def park(self, delivery: Delivery, key: Any, error: Any, attempts: int, session: Any) -> None:
        name = key_id(key)
        if error is not None and self.parked.get(name) is None:
            self.revision += 1
            self.parked.apply(name, parked(key), self.revision)
        self.queues.setdefault(name, []).append(delivery)

    def replay(self, partition: int, key: Any, handle: Any, stopped: threading.Event) -> bool:
        queue = self.queues.get(key_id(key), [])
        while queue:
            if not handle(queue[0]):
                return False
            queue.pop(0)
        self.purge(key)
        return True

    def purge(self, key: Any) -> None:
        self.queues.pop(key_id(key), None)
        self.revision += 1
        self.parked.apply(key_id(key), None, self.revision)


def wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def headers(key: str, control: str | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"partq-key": key, "partq-partition": PARTITION}
    if control is not None:
        found["x-partq-control"] = control
    return found


def test_a_failing_key_parks_its_later_messages_and_others_flow() -> None:
    # Given a parking worker whose handler fails for key "bad"
    parking = FakeParking()
    fail = {"bad"}

    def behaviour(message: Any) -> None:
        if message.key in fail:
            raise ValueError(message.message_id)

    run = Run(behaviour, parking=parking, max_attempts=2)
    run.deliver("g1", headers("good"))
    run.deliver("b1", headers("bad"))  # fails twice: parks "bad"
    run.deliver("g2", headers("good"))
    run.deliver("b2", headers("bad"))  # parked unhandled, behind b1
    wait_for(lambda: len(parking.queues.get(key_id("bad"), [])) == 2)
    # When the handler is fixed and a redrive request arrives
    fail.clear()
    run.deliver("r", headers("bad", "redrive"))
    run.deliver("b3", headers("bad"))  # newer than the redrive: handled after the replay
    run.end()
    # Then the others flowed, the parked ones were replayed in order ahead of b3
    assert run.handled == ["g1", "g2", "b1", "b2", "b3"]
    assert [s[0] for s in run.seen].count("b1") == 3  # two failed attempts, one replay
    assert run.broker.acked == [1, 2, 3, 4, 5, 6]  # each acked once parked or handled
    assert parking.parked.get(key_id("bad")) is None
    assert run.dead.published == []


def test_a_control_message_is_never_handed_to_the_handler() -> None:
    parking = FakeParking()
    run = Run(parking=parking)
    run.deliver("r", headers("k", "redrive"))  # not parked: nothing to do
    run.deliver("p", headers("k", "purge"))
    run.end()
    assert run.handled == []
    assert run.broker.acked == [1, 2]


def test_a_purge_drops_the_parked_messages_and_unparks() -> None:
    parking = FakeParking()
    fail = True

    def behaviour(message: Any) -> None:
        if fail:
            raise ValueError("boom")

    run = Run(behaviour, parking=parking, max_attempts=1)
    run.deliver("b1", headers("bad"))
    run.deliver("b2", headers("bad"))
    run.deliver("p", headers("bad", "purge"))
    run.end()
    assert run.handled == []
    assert parking.queues == {}
    assert parking.parked.get(key_id("bad")) is None


def test_without_parking_an_exhausted_message_is_dead_lettered_alone() -> None:
    run = Run(lambda m: (_ for _ in ()).throw(ValueError("x")) if m.key == "bad" else None)
    run.deliver("b1", headers("bad"))
    run.deliver("b2", headers("bad"))
    run.end()
    assert [d[0] for d in run.dead.published] == ["b1", "b2"]

"""Per-key parking, pure parts and the worker with fakes: what parks, what flows, replays."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pika
import pytest
from hypothesis import given
from hypothesis import strategies as st
from partq.consumers.broker.port import Delivery
from partq.consumers.control.redrive import senders, users_of
from partq.consumers.handling.parking import ParkedKeys, ParkStalls, too_many
from partq.consumers.handling.worker import HANDLER_TIMEOUT
from partq.coordinator.store import codec, kinds
from partq.coordinator.store.codec import Parked
from partq.producer.contract import PLAIN_KEY_ID_BYTES, StreamSpec, key_bytes, key_id, park_queue

from partq.kernel.amqp import AmqpTarget, AmqpTLS
from partq.kernel.backoff import Backoff
from partq.kernel.errors import MalformedValue

from .test_worker import PARTITION, SPEC, Run

OPERATOR = f"partq-{SPEC.name}-operator"


def parked(key: str | bytes, partition: int = PARTITION) -> Parked:
    long = key_bytes(key) if len(key_bytes(key)) > PLAIN_KEY_ID_BYTES else b""
    return Parked(
        key_id(key), partition, "ValueError: boom", "ValueError", "m1", "c1", 1.0, long_key=long
    )


@given(st.binary(min_size=1, max_size=300))
def test_a_parked_record_round_trips_for_any_key(key: bytes) -> None:
    record = parked(key)
    decoded = kinds.decode("parked", "s", record.key_id, codec.encode_parked(record))
    assert decoded == record
    assert decoded.key == key


def test_text_and_bytes_keys_are_one_key_and_one_queue() -> None:
    assert key_id("k€") == key_id("k€".encode())
    assert park_queue("s", "k€") == park_queue("s", "k€".encode())
    assert park_queue("s", "a") != park_queue("s", "b")
    assert parked(b"\xff\x00").key_text == "b64:/wA="
    assert parked("orders-7").key_text == "orders-7"


@pytest.mark.parametrize("size", [PLAIN_KEY_ID_BYTES + 1, 60_000, 131_000])
def test_a_long_key_is_named_by_its_digest_and_its_record_holds_it(size: int) -> None:
    key = bytes(range(256)) * (size // 256) + b"k" * (size % 256)
    record = parked(key)
    assert record.key_id.startswith("sha256.") and len(record.key_id) == 71
    decoded = kinds.decode("parked", "s", record.key_id, codec.encode_parked(record))
    assert decoded == record and decoded.key == key
    assert park_queue("s", decoded.key) == park_queue("s", key)
    assert len(decoded.key_shown) < 130 and f"({size} bytes)" in decoded.key_shown


def test_a_key_up_to_the_limit_keeps_its_readable_id() -> None:
    key = "k" * PLAIN_KEY_ID_BYTES
    assert len(key_id(key)) == 2048 and parked(key).key == key.encode()


def test_a_long_key_record_that_does_not_hold_its_key_is_malformed() -> None:
    record = parked(b"x" * 2000)
    other = codec.encode_parked(parked(b"y" * 2000))
    with pytest.raises(MalformedValue, match="not the key"):
        kinds.decode("parked", "s", record.key_id, other)
    with pytest.raises(MalformedValue):
        kinds.decode("parked", "s", record.key_id, codec.encode_parked(parked("short")))
    with pytest.raises(ValueError, match="not the key it names"):
        codec.encode_parked(Parked(record.key_id, 1, "e", "E", "m", "c1", 1.0, long_key=b"other"))


def test_a_parked_key_name_must_be_base64url() -> None:
    with pytest.raises(MalformedValue):
        kinds.decode("parked", "s", "not/base64", codec.encode_parked(parked("k")))


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

    def __init__(self, limit: int = 1000, failures: int = 0) -> None:
        self.parked = ParkedKeys()
        self.queues: dict[str, list[Delivery]] = {}
        self.revision = 0
        self.limit = limit
        self.senders = senders(SPEC.name, ["guest"])
        self.failures = failures  # parks that fail first (etcd or RabbitMQ refusing)
        self.changes: list[list[int]] = []  # what was stalled at each on_change
        self.stalls = ParkStalls(("s", "m"), lambda: self.changes.append(self.stalls.stalled()))

    def refuse(self, error: BaseException) -> Any:
        return too_many(SPEC.name, len(self.parked), self.limit, error)

    def park(self, delivery: Delivery, key: Any, error: Any, attempts: int, session: Any) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError(f"etcd refused parked/{key_id(key)}")
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
    run.deliver("r", headers("bad", "redrive"), OPERATOR)
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
    run.deliver("r", headers("k", "redrive"), OPERATOR)  # not parked: nothing to do
    run.deliver("p", headers("k", "purge"), "guest")
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
    run.deliver("p", headers("bad", "purge"), f"partq-{SPEC.name}-admin")
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


@pytest.mark.parametrize("sender", [None, "partq-orders-producer", "partq-other-operator"])
def test_a_control_message_from_anyone_else_is_dead_lettered_unobeyed(sender: str | None) -> None:
    # Given a parked key
    parking = FakeParking()
    run = Run(lambda m: (_ for _ in ()).throw(ValueError("boom")), parking=parking, max_attempts=1)
    run.deliver("b1", headers("bad"))
    wait_for(lambda: len(parking.queues.get(key_id("bad"), [])) == 1)
    # When a purge arrives from a user that is not the stream's operator, admin or own user
    run.deliver("p", headers("bad", "purge"), sender)
    run.end()
    # Then it is dead-lettered as forged, acked, and the key stays parked with its message
    ((message_id, error, attempts),) = run.dead.published
    assert (message_id, type(error).__name__, attempts) == ("p", "ForgedControl", 0)
    assert f"sent by user {sender!r}" in str(error)
    assert run.broker.acked == [1, 2]
    assert len(parking.queues[key_id("bad")]) == 1
    assert parking.parked.get(key_id("bad")) is not None
    assert run.metric("partq_consumer_header_problems_total", problem="forged_control") == 1


def test_a_redrive_dead_letters_what_was_never_the_keys_and_hands_the_rest_on() -> None:
    # Given a parked key whose parking queue also holds what a consumer's user routed into it
    # through an exchange it may publish to: a purge request, a fence, a filler, another
    # key's message, a keyless one, one with malformed headers, and the same key as bytes
    parking = FakeParking()
    fail = True

    def behaviour(message: Any) -> None:
        if fail:
            raise ValueError("boom")

    run = Run(behaviour, parking=parking, max_attempts=1)
    run.deliver("b1", headers("bad"))
    wait_for(lambda: len(parking.queues.get(key_id("bad"), [])) == 1)
    queue = parking.queues[key_id("bad")]
    foreign = {
        "purge": headers("bad", "purge"),
        "fence": {**headers("bad"), "x-partq-control": "fence", "x-partq-epoch": 0},
        "fill": {"x-partq-control": b"fill"},
        "other": headers("good"),
        "keyless": {"partq-partition": PARTITION},
        "malformed": {"partq-key-b64": "not base64!"},
    }
    for tag, (message_id, found) in enumerate(foreign.items(), start=100):
        props = pika.BasicProperties(message_id=message_id, headers=found)
        queue.append(Delivery(PARTITION, run.channel, tag, False, props, b"x"))  # type: ignore[arg-type]
    props = pika.BasicProperties(message_id="b2", headers={"partq-key-b64": "YmFk"})  # b"bad"
    queue.append(Delivery(PARTITION, run.channel, 200, False, props, b"b2"))  # type: ignore[arg-type]
    # When the handler is fixed and the key redriven
    fail = False
    run.deliver("r", headers("bad", "redrive"), OPERATOR)
    run.end()
    # Then the handler saw the key's own messages only; the rest went to the DLQ, each
    # with its reason, and the key is unparked
    assert run.handled == ["b1", "b2"]
    dead = {
        message_id: (type(error).__name__, str(error))
        for message_id, error, _ in run.dead.published
    }
    assert set(dead) == set(foreign)
    assert {kind for kind, _ in dead.values()} == {"ForeignParked"}
    assert "a resize's fence in the parking queue of key 'bad'" in dead["fence"][1]
    assert "a drain's filler" in dead["fill"][1]
    assert "a control message (x-partq-control: 'purge')" in dead["purge"][1]
    assert "a message of key 'good'" in dead["other"][1]
    assert "without a partq key" in dead["keyless"][1]
    assert "malformed partq headers" in dead["malformed"][1]
    assert parking.parked.get(key_id("bad")) is None
    assert run.metric("partq_consumer_header_problems_total", problem="foreign_parked") == 6


def test_past_the_parked_key_limit_a_failing_key_is_dead_lettered_and_flows_on() -> None:
    # Given a stream that may park one key, and key "a" parked
    parking = FakeParking(limit=1)
    failing = {"a", "b"}

    def behaviour(message: Any) -> None:
        if message.key in failing:
            raise ValueError(message.message_id)

    run = Run(behaviour, parking=parking, max_attempts=1)
    run.deliver("a1", headers("a"))
    # When key "b" fails too, then recovers
    run.deliver("b1", headers("b"))
    wait_for(lambda: len(run.dead.published) == 1)
    failing.discard("b")
    run.deliver("b2", headers("b"))
    run.end()
    # Then "b1" is dead-lettered (not lost) saying why, and "b" was not parked: b2 handled
    ((message_id, error, attempts),) = run.dead.published
    assert (message_id, type(error).__name__, attempts) == ("b1", "TooManyParkedKeys", 1)
    assert "ValueError: b1 (not parked: stream 'orders' has 1 parked keys, the limit" in str(error)
    assert parking.parked.get(key_id("b")) is None
    assert run.handled == ["b2"]
    assert run.broker.acked == [1, 2, 3]


def test_the_senders_are_the_operator_admin_and_each_of_the_consumers_own_users() -> None:
    url = "amqp://guest:guest@h1/%2F,amqps://app%40corp:pw@h2/%2F"
    assert senders("orders", users_of(url)) == {
        "partq-orders-operator",
        "partq-orders-admin",
        "guest",
        "app@corp",
    }
    external = AmqpTarget("amqps://h1/%2F", AmqpTLS(external_auth=True))
    assert senders("orders", users_of(external)) == {"partq-orders-operator", "partq-orders-admin"}


def test_a_failing_park_is_logged_once_with_the_key_cut_short_and_reported_until_it_works(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a parking worker whose parks fail 4 times, for a key of 60,000 bytes
    caplog.set_level(logging.INFO, "partq.consumer")
    monkeypatch.setattr("partq.consumers.handling.keyparking.RETRY_BACKOFF", Backoff(initial=0.001))
    parking = FakeParking(failures=4)
    key = "k" * 60_000

    def behaviour(message: Any) -> None:
        raise ValueError("boom")

    run = Run(behaviour, parking=parking, max_attempts=1)
    run.deliver("b1", headers(key))
    run.end()
    # Then the message is parked in the end, and acked only then
    assert len(parking.queues[key_id(key)]) == 1 and run.broker.acked == [1]
    # And the stall was told once when it began and once when it ended, never 60 KB long
    assert parking.changes == [[PARTITION], []]
    lines = [r.getMessage() for r in caplog.records]
    assert max(len(line) for line in lines) < 1000
    began = [line for line in lines if "cannot park key" in line]
    assert len(began) == 1 and "(60000 bytes)" in began[0], lines
    assert sum("parked after 4 failed attempts" in line for line in lines) == 1
    assert not [line for line in lines if "still fails" in line]  # within the first minute


def test_a_long_stall_is_summed_up_once_a_minute(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, "partq.consumer")
    now = [1000.0]
    monkeypatch.setattr("partq.consumers.handling.parking.time.monotonic", lambda: now[0])
    stalls = ParkStalls(("s", "m"), lambda: None)
    for _ in range(200):  # every 0.5 s for 100 s
        stalls.failed(3, b"key", RuntimeError("no"))
        now[0] += 0.5
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "still fails: 121 attempts in 60s" in lines[1], lines
    assert stalls.stalled() == [3]
    stalls.ended(3, parked=False)
    assert stalls.stalled() == [] and "left unparked" in caplog.records[-1].getMessage()


def test_a_redrive_whose_handler_times_out_leaves_the_message_parked_not_dead_lettered() -> None:
    # Given a parked key, then a handler that hangs on its parked message during the redrive
    parking = FakeParking()
    hang, release = threading.Event(), threading.Event()

    def behaviour(message: Any) -> None:
        if not hang.is_set():
            raise ValueError("boom")
        release.wait(30)

    run = Run(behaviour, parking=parking, max_attempts=1, handler_timeout=0.3)
    try:
        run.deliver("b1", headers("bad"))
        wait_for(lambda: len(parking.queues.get(key_id("bad"), [])) == 1)
        hang.set()
        # When the redrive's handler call runs past the handler timeout
        run.deliver("r", headers("bad", "redrive"), OPERATOR)
        assert run.failed.wait(5)
        # Then the member leaves for a restart, and the message is not also dead-lettered:
        # it stays parked (the replay never acked it), once
        assert run.failures == [(PARTITION, HANDLER_TIMEOUT)]
        assert run.dead.published == []
        assert [d.body for d in parking.queues[key_id("bad")]] == [b"b1"]
    finally:
        release.set()
    run.worker.join(5)
    assert parking.parked.get(key_id("bad")) is not None

"""Per-key parking and ``partq dlq`` under load, on real etcd and RabbitMQ.

Given a parking stream, two consumers and a keyed load, when one key's messages start to
fail, then that key is parked (its failing message and every later one wait in its
parking queue, in order) while every other key flows on, also after the partition's owner
is killed and another member takes it over; when the handler is fixed and the key
redriven, every parked message is handled exactly once, in order, ahead of anything newer
of the key, and nothing is lost.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import pytest
from partq.consumers.broker.port import Delivery
from partq.consumers.handling.parking import ParkedKeys, Parking
from partq.coordinator.ops import dlq
from partq.coordinator.store.group import Group
from partq.coordinator.store.session import Session
from partq.producer import Producer, StreamSpec
from partq.producer.contract import (
    CONTROL_FENCE,
    CONTROL_FILL,
    HEADER_CONTROL,
    HEADER_EPOCH,
    HEADER_PARTITION,
    encode_key,
    key_id,
)
from partq.producer.queue_arguments import park_queue_arguments
from partq.producer.registry import Registry

from examples import audit
from partq.kernel.amqp import connect_blocking

from .groups.harness import (
    PARTQ,
    PREFETCH,
    ROOT,
    Fleet,
    Proc,
    SequenceProducer,
    balanced,
    wait_until,
)

pytestmark = [pytest.mark.integration]

P = 4
POISON_KEY = "key-005"
POISON_SEQ = 30


def partq(fleet: Fleet, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(PARTQ), *args], env=fleet._env(), cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    if check:
        assert done.returncode == 0, done.stderr
    return done


def seqs(records: list[dict[str, Any]], key: str) -> list[int]:
    return [r["seq"] for r in records if r["key"] == key]


def poisoned_stream(
    quorum_fleet: Callable[..., Fleet], tmp_path: Path, seq: int, slow: float = 0.0
) -> tuple[Fleet, StreamSpec, Path]:
    """A parking stream whose consumers' handler fails POISON_KEY's messages from ``seq``
    on while the returned flag file exists (and takes ``slow`` s for each of them)."""
    fleet = quorum_fleet(P, "park")
    flag = tmp_path / "poisoned"
    flag.touch()
    fleet.env.update(
        PARTQ_POISON_KEY=POISON_KEY, PARTQ_POISON_SEQ=str(seq), PARTQ_POISON_FLAG=str(flag),
        PARTQ_POISON_SLOW=str(slow),
    )  # fmt: skip
    return fleet, StreamSpec(fleet.stream, P, "quorum", on_failure="park"), flag


def parked_key(
    quorum_fleet: Callable[..., Fleet],
    registry: Registry,
    rabbitmq: str,
    tmp_path: Path,
    messages: int,
    slow: float = 0.0,
) -> tuple[Fleet, StreamSpec, Path, Group, dict[str, Proc]]:
    """POISON_KEY parked with ``messages`` messages (ids ``p:<seq>``) waiting, on a
    coordinator and two consumers that fail it while the flag file exists."""
    fleet, spec, flag = poisoned_stream(quorum_fleet, tmp_path, 0, slow=slow)
    group = Group(registry.client, registry.where, fleet.stream)
    fleet.coordinator(settle=0.5)
    extra = ("--max-attempts", "1")
    members = {m: fleet.consumer(m, handler="poison_key", extra=extra) for m in ("c1", "c2")}
    wait_until(lambda: balanced(group, P, set(members)), 30, 0.1, "balanced")
    with Producer(spec, amqp_url=rabbitmq) as producer:
        for seq in range(messages):
            producer.publish(POISON_KEY, json.dumps({"seq": seq}).encode(), message_id=f"p:{seq}")
        producer.flush(30)
    wait_until(
        lambda: [k.messages for k in dlq.parked_keys(registry, rabbitmq, spec)] == [messages],
        30,
        0.2,
        "parked",
    )
    return fleet, spec, flag, group, members


def test_a_failing_key_is_parked_across_a_crash_then_redriven_in_order(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str, tmp_path: Path
) -> None:
    fleet, spec, flag = poisoned_stream(quorum_fleet, tmp_path, POISON_SEQ)
    group = Group(registry.client, registry.where, fleet.stream)
    fleet.coordinator(settle=0.5)
    extra = ("--max-attempts", "2")
    members = {m: fleet.consumer(m, handler="poison_key", extra=extra) for m in ("c1", "c2")}
    wait_until(lambda: balanced(group, P, set(members)), 30, 0.1, "balanced")
    load = SequenceProducer(spec, rabbitmq, keys=8, rate=160.0)  # 20 rounds/s
    load.start()
    try:
        # When key-005's messages from seq 30 on fail every attempt
        wait_until(lambda: key_id(POISON_KEY) in group.parked(), 30, 0.1, "the key parked")
        parked = group.parked()[key_id(POISON_KEY)]
        assert parked.partition == spec.partition_for(POISON_KEY)
        assert parked.message_id == f"{POISON_KEY}:{POISON_SEQ}"
        assert parked.error_type == "ValueError"
        # Then the other keys flow on: each is handled 60 rounds (3 s) past the parked seq
        others = [f"key-{i:03d}" for i in range(8) if f"key-{i:03d}" != POISON_KEY]
        wait_until(
            lambda: all(max(seqs(fleet.records(), k)) >= POISON_SEQ + 60 for k in others),
            30,
            0.2,
            "the other keys flowing",
        )
        assert max(seqs(fleet.records(), POISON_KEY)) == POISON_SEQ - 1

        # When the parked partition's owner is killed, the other member takes it over
        owner = group.snapshot().claims[parked.partition].member
        killed = audit.Crash(time.time(), PREFETCH, members[owner].pid)
        members[owner].signal(signal.SIGKILL)
        members[owner].popen.wait(10)
        (rest,) = set(members) - {owner}
        wait_until(
            lambda: balanced(group, P, {rest}), 30, 0.1, "the survivor owning every partition"
        )
        before = load.started
        wait_until(lambda: load.started > before + 20, 10, 0.1, "more load after the takeover")
    finally:
        load.stop()
    sent = load.published()
    # Then the key stays parked: its messages from seq 30 wait in its parking queue
    poisoned = sorted(s for k, s in sent if k == POISON_KEY and s >= POISON_SEQ)
    wait_until(
        lambda: not [m for m in audit.lost(sent, fleet.records()) if m[0] != POISON_KEY],
        30,
        0.25,
        "every other key handled",
    )
    listed = json.loads(partq(fleet, "dlq", "list", fleet.stream, "--json").stdout)
    (entry,) = listed["parked"]
    assert entry["key"] == POISON_KEY
    counts: list[int] = []

    def all_parked() -> bool:  # more if the kill fell between parks and their acks: the
        # redrive drops those copies (checked below: each handled exactly once)
        counts.append(dlq.parked_keys(registry, rabbitmq, spec)[0].messages)
        return counts[-1] >= len(poisoned)

    try:
        wait_until(all_parked, 30, 0.25, f"{len(poisoned)} messages parked")
    except AssertionError as e:
        raise AssertionError(f"{e}; parking queue depths seen last: {counts[-4:]}") from None
    assert max(seqs(fleet.records(), POISON_KEY)) == POISON_SEQ - 1

    # When the handler is fixed and the key redriven
    flag.unlink()
    done = partq(fleet, "dlq", "redrive", fleet.stream, "--key", POISON_KEY)
    assert "unparked" in done.stdout
    # Then every parked message is handled once, in order, and nothing is lost
    assert group.parked() == {}
    wait_until(lambda: not audit.lost(sent, fleet.records()), 30, 0.25, "all handled")
    records = fleet.records()
    assert seqs(records, POISON_KEY) == sorted(s for k, s in sent if k == POISON_KEY)
    assert Counter(seqs(records, POISON_KEY)).most_common(1)[0][1] == 1
    assert audit.order_violations(records, [killed]) == []
    # And the key flows again: a new message of it is handled, not parked
    with Producer(spec, amqp_url=rabbitmq) as producer:
        producer.publish(POISON_KEY, json.dumps({"seq": 10_000}).encode()).result(30)
    wait_until(lambda: 10_000 in seqs(fleet.records(), POISON_KEY), 30, 0.1, "handled again")
    assert group.parked() == {}


def test_a_copy_parked_twice_by_a_crash_is_replayed_once(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str
) -> None:
    # Given a parked key whose parking queue holds m0, m1, then a copy of m0: an owner
    # killed after parking m0 but before acking it left it to the next owner to park again
    fleet = quorum_fleet(P, "park")
    spec = StreamSpec(fleet.stream, P, "quorum", on_failure="park")
    group = Group(registry.client, registry.where, fleet.stream)
    parking = Parking(rabbitmq, spec, "m", group, ParkedKeys())
    session = Session(registry.client, registry.where, ttl=30)
    try:
        partition = spec.partition_for(POISON_KEY)
        group.join(session, "m")
        assert group.claim(partition, "m", session)  # only the partition's holder parks

        def delivery(seq: int) -> Delivery:
            props = pika.BasicProperties(message_id=f"{POISON_KEY}:{seq}", headers={})
            body = json.dumps({"key": POISON_KEY, "seq": seq}).encode()
            return Delivery(partition, None, seq, False, props, body)  # type: ignore[arg-type]

        parking.park(delivery(0), POISON_KEY, ValueError("poisoned"), 2, session)
        for seq in (1, 0):
            parking.park(delivery(seq), POISON_KEY, None, 0, session)
        assert dlq.parked_keys(registry, rabbitmq, spec)[0].messages == 3
        # When the key is replayed / Then m0 and m1 are handled once each, in order
        handled: list[bytes] = []
        stopped = threading.Event()
        assert parking.replay(partition, POISON_KEY, lambda d: not handled.append(d.body), stopped)
        assert [json.loads(b)["seq"] for b in handled] == [0, 1]
        assert group.parked() == {}
    finally:
        parking.close()
        session.close(revoke=True)


def test_a_stream_made_before_the_parking_exchange_parks_and_replays_through_it(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str
) -> None:
    # Given a stream as an older partq made it: no parking exchange, and a parking queue
    # bound to the dead-letter exchange holding one parked message
    fleet = quorum_fleet(P, "park")
    spec = StreamSpec(fleet.stream, P, "quorum", on_failure="park")
    queue = spec.park_queue(POISON_KEY)
    headers = {**encode_key(POISON_KEY), "x-partq-parked": "failed"}
    with connect_blocking(rabbitmq, name="test-older-partq") as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.exchange_delete(spec.park_exchange)
        channel.queue_declare(queue, durable=True, arguments=park_queue_arguments(spec))
        channel.queue_bind(queue, spec.dead_letter_exchange, routing_key=queue)
        properties = pika.BasicProperties(message_id="p:0", headers=headers)
        channel.basic_publish(spec.dead_letter_exchange, queue, b'{"seq": 0}', properties)
    group = Group(registry.client, registry.where, fleet.stream)
    parking = Parking(rabbitmq, spec, "m", group, ParkedKeys())
    session = Session(registry.client, registry.where, ttl=30)
    try:
        partition = spec.partition_for(POISON_KEY)
        group.join(session, "m")
        assert group.claim(partition, "m", session)
        # When this partq parks the key's next message (its user may declare the exchange)
        props = pika.BasicProperties(message_id="p:1", headers=encode_key(POISON_KEY))
        delivery = Delivery(partition, None, 1, False, props, b'{"seq": 1}')  # type: ignore[arg-type]
        parking.park(delivery, POISON_KEY, ValueError("poisoned"), 1, session)
        # Then the parking exchange exists again and holds the queue's binding; the replay
        # hands over both messages, in order, whichever exchange fed them
        with connect_blocking(rabbitmq, name="test-check") as connection:
            connection.channel().exchange_declare(spec.park_exchange, passive=True)
        handled: list[bytes] = []
        assert parking.replay(
            partition, POISON_KEY, lambda d: not handled.append(d.body), threading.Event()
        )
        assert [json.loads(b)["seq"] for b in handled] == [0, 1]
        assert group.parked() == {}
    finally:
        parking.close()
        session.close(revoke=True)


def test_a_redrive_interrupted_by_a_crash_is_finished_by_the_next_owner(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str, tmp_path: Path
) -> None:
    # Given a parked key with 100 messages waiting, and a handler that is slow for it
    fleet, spec, flag, group, members = parked_key(
        quorum_fleet, registry, rabbitmq, tmp_path, 100, slow=0.05
    )
    flag.unlink()
    # When a redrive starts and the owner is killed -9 in the middle of the replay
    first = partq(fleet, "dlq", "redrive", fleet.stream, "--timeout", "0.5", check=False)
    assert first.returncode == 1 and "still parked" in first.stderr, first.stderr
    wait_until(lambda: len(seqs(fleet.records(), POISON_KEY)) >= 10, 30, 0.05, "replaying")
    owner = group.snapshot().claims[spec.partition_for(POISON_KEY)].member
    members[owner].signal(signal.SIGKILL)
    members[owner].popen.wait(10)
    replayed_before = len(seqs(fleet.records(), POISON_KEY))
    # And the redrive is run again, twice
    again = partq(fleet, "dlq", "redrive", fleet.stream, check=False)
    partq(fleet, "dlq", "redrive", fleet.stream)
    # Then the next owner finished the replay: every message handled, in order, none lost;
    # only the one in flight at the kill may be handled twice (at-least-once)
    assert group.parked() == {}, again.stderr
    handled = seqs(fleet.records(), POISON_KEY)
    assert sorted(set(handled)) == list(range(100))
    assert len(handled) - 100 <= 1, f"{len(handled) - 100} handled twice"
    assert 10 <= replayed_before < 100, "the kill did not interrupt the replay"
    deduplicated = [s for i, s in enumerate(handled) if s not in handled[:i]]
    assert deduplicated == list(range(100))


def test_a_redrive_whose_replay_fails_returns_at_once_with_the_error(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str, tmp_path: Path
) -> None:
    # Given a parked key whose handler still fails
    fleet, spec, _flag, _group, _members = parked_key(quorum_fleet, registry, rabbitmq, tmp_path, 3)
    # When it is redriven with a long timeout
    started = time.monotonic()
    done = partq(fleet, "dlq", "redrive", fleet.stream, "--timeout", "120", check=False)
    took = time.monotonic() - started
    # Then the command returns once the replay failed, with the handler's error
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the replay failed again, the key stays parked" in done.stderr
    assert f"{POISON_KEY}: ValueError: poisoned message p:0" in done.stderr
    assert took < 60, f"{took:.1f}s: the command waited for its timeout"
    # And the key stays parked with every message, the failure on record
    (parked,) = dlq.parked_keys(registry, rabbitmq, spec)
    assert parked.messages == 3
    assert parked.record.redrive_error == "ValueError: poisoned message p:0"
    assert seqs(fleet.records(), POISON_KEY) == []


def test_a_redrive_hands_the_handler_only_the_keys_own_parked_messages(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str, tmp_path: Path
) -> None:
    # Given a parked key with 2 messages waiting, and what a consumer's user can route into
    # its parking queue through the dead-letter exchange (bound as an older partq bound it):
    # a purge request, a resize's fence, a drain's filler, another key's message and a
    # keyless one
    fleet, spec, flag, group, _members = parked_key(quorum_fleet, registry, rabbitmq, tmp_path, 2)
    queue = spec.park_queue(POISON_KEY)
    partition = spec.partition_for(POISON_KEY)
    foreign = {
        "forged-purge": {**encode_key(POISON_KEY), HEADER_CONTROL: "purge"},
        "forged-fence": {HEADER_CONTROL: CONTROL_FENCE, HEADER_EPOCH: 0, HEADER_PARTITION: 0},
        "forged-fill": {HEADER_CONTROL: CONTROL_FILL},
        "forged-other": {**encode_key("key-999"), HEADER_PARTITION: partition},
        "forged-keyless": {},
    }
    with connect_blocking(rabbitmq, name="test-attacker") as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.queue_bind(queue, spec.dead_letter_exchange, routing_key=queue)
        for seq, (message_id, headers) in enumerate(foreign.items(), start=900):
            properties = pika.BasicProperties(message_id=message_id, headers=headers)
            body = json.dumps({"seq": seq}).encode()
            channel.basic_publish(
                spec.dead_letter_exchange, queue, body, properties, mandatory=True
            )
    assert [k.messages for k in dlq.parked_keys(registry, rabbitmq, spec)] == [7]
    # When the handler is fixed and the key redriven
    flag.unlink()
    done = partq(fleet, "dlq", "redrive", fleet.stream, "--key", POISON_KEY)
    assert "unparked" in done.stdout
    # Then the handler saw the key's 2 messages, nothing else
    wait_until(lambda: len(seqs(fleet.records(), POISON_KEY)) >= 2, 30, 0.1, "replayed")
    time.sleep(0.5)  # anything handled after them would be recorded by now
    records = fleet.records()
    assert seqs(records, POISON_KEY) == [0, 1]
    assert [r for r in records if r["seq"] >= 900] == []
    # And the others are in the DLQ, each with the reason
    dead = _dead_letters(rabbitmq, spec, len(foreign))
    assert set(dead) == set(foreign)
    assert {h["x-partq-error-type"] for h in dead.values()} == {"ForeignParked"}
    assert (
        "a message of key 'key-999' in the parking queue" in dead["forged-other"]["x-partq-error"]
    )
    assert "a resize's fence" in dead["forged-fence"]["x-partq-error"]
    assert group.parked() == {}


def _dead_letters(rabbitmq: str, spec: StreamSpec, count: int) -> dict[str, dict[str, Any]]:
    """The headers of ``count`` dead letters taken off the DLQ, by message id."""
    found: dict[str, dict[str, Any]] = {}
    with connect_blocking(rabbitmq, name="test-dlq") as connection:
        channel = connection.channel()
        deadline = time.monotonic() + 30
        while len(found) < count and time.monotonic() < deadline:
            method, properties, _body = channel.basic_get(spec.dead_letter_queue, auto_ack=True)
            if method is None:
                time.sleep(0.1)
                continue
            found[str(properties.message_id)] = dict(properties.headers or {})
    return found


def test_a_60000_byte_key_is_parked_and_its_partition_flows_on(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str, tmp_path: Path
) -> None:
    # Given a parking stream whose handler fails every message of one 60,000-byte key, and
    # other keys, two of them in that key's partition
    long_key = "L" * 59_990 + "-the-end!!"
    fleet, spec, flag = poisoned_stream(quorum_fleet, tmp_path, 0)
    fleet.env["PARTQ_POISON_KEY"] = long_key
    partition = spec.partition_for(long_key)
    neighbours = [
        k for k in (f"key-{i:03d}" for i in range(200)) if spec.partition_for(k) == partition
    ]
    others = [*neighbours[:2], *(f"other-{i}" for i in range(6))]
    group = Group(registry.client, registry.where, fleet.stream)
    fleet.coordinator(settle=0.5)
    args = ["consume", fleet.stream, "--handler", "tests.integration.groups.recorder:poison_key"]
    args += ["--member-id", "c1", "--ttl", "2", "--http-port", "0", "--max-attempts", "2"]
    c1 = fleet._start("c1", args, fleet._env(PARTQ_MEMBER_ID="c1"))  # no --debug: pika's
    # debug lines would print the headers, the key among them
    wait_until(lambda: balanced(group, P, {"c1"}), 30, 0.1, "c1 owning every partition")
    # When the long key's messages come between the others'
    sent: set[tuple[str, int]] = set()
    with Producer(spec, amqp_url=rabbitmq) as producer:
        for seq in range(20):
            for key in [*others, long_key] if seq < 5 else others:
                producer.publish(key, json.dumps({"seq": seq}), message_id=f"{key[-8:]}:{seq}")
                sent.add((key, seq))
        producer.flush(30)
    # Then every other key is handled, in order, and the long key is parked (a fixed-size id)
    expected = {m for m in sent if m[0] != long_key}
    try:
        wait_until(lambda: not audit.lost(expected, fleet.records()), 30, 0.25, "others handled")
    except AssertionError:
        print(c1.tail(20)[-3000:])
        raise
    name = key_id(long_key)
    wait_until(lambda: name in group.parked(), 10, 0.1, "the long key parked")
    assert name.startswith("sha256.")
    records = fleet.records()
    assert audit.order_violations(records) == []
    assert not [r for r in records if r["key"] == long_key]
    assert dlq.parked_keys(registry, rabbitmq, spec)[0].messages == 5
    # And `partq dlq list` shows the whole key; `partq status` shows it cut short
    (entry,) = json.loads(partq(fleet, "dlq", "list", fleet.stream, "--json").stdout)["parked"]
    assert entry["key"] == long_key and entry["partition"] == partition
    status = partq(fleet, "status", fleet.stream).stdout
    assert "(60000 bytes)" in status and len(status) < 20_000
    # And no log line carries the key
    longest = max(len(line) for line in c1.log.read_text(errors="replace").splitlines())
    assert longest < 2000, f"a log line of {longest} characters"
    # When the handler is fixed and the key redriven (the whole key on the command line)
    flag.unlink()
    done = partq(fleet, "dlq", "redrive", fleet.stream, "--key", long_key)
    assert "unparked" in done.stdout
    # Then its parked messages are handled, in order
    wait_until(lambda: not audit.lost(sent, fleet.records()), 30, 0.25, "all handled")
    assert seqs(fleet.records(), long_key) == list(range(5))
    assert group.parked() == {}


def test_a_parked_key_that_a_resize_moves_keeps_its_parked_messages_ahead_of_its_new_ones(
    quorum_fleet: Callable[..., Fleet], registry: Registry, rabbitmq: str, tmp_path: Path
) -> None:
    # Given POISON_KEY parked in partition 0 of 4, with 5 messages waiting
    fleet, spec, flag, group, members = parked_key(quorum_fleet, registry, rabbitmq, tmp_path, 5)
    assert spec.partition_for(POISON_KEY) == 0
    # When the stream grows 4 -> 7, which moves the key to partition 6
    partq(fleet, "stream", "resize", fleet.stream, "--partitions", "7", "--wait")
    grown = registry.read_spec(fleet.stream)
    assert (grown.partitions, grown.partition_for(POISON_KEY)) == (7, 6)
    wait_until(lambda: balanced(group, 7, set(members)), 30, 0.1, "balanced over 7")
    # and 5 more of its messages are published under the new layout
    with Producer(fleet.stream, amqp_url=rabbitmq, etcd=registry) as producer:
        for seq in range(5, 10):
            producer.publish(POISON_KEY, json.dumps({"seq": seq}).encode(), message_id=f"p:{seq}")
        producer.flush(30)
    # Then partition 6's owner parks them behind the 5 (the key is parked, wherever it is)
    wait_until(
        lambda: [k.messages for k in dlq.parked_keys(registry, rabbitmq, grown)] == [10],
        30,
        0.2,
        "the new messages parked behind the old",
    )
    assert seqs(fleet.records(), POISON_KEY) == []
    # When the handler is fixed and the key redriven while 50 more of its messages are
    # published (so that some are parked while the replay runs, some after it)
    flag.unlink()
    more = threading.Thread(target=_publish_seqs, args=(fleet.stream, rabbitmq, registry, 10, 60))
    more.start()
    try:
        partq(fleet, "dlq", "redrive", fleet.stream, "--key", POISON_KEY)
    finally:
        more.join(60)
    # Then every message of the key is handled once, in publish order, across the resize
    wait_until(lambda: len(seqs(fleet.records(), POISON_KEY)) >= 60, 30, 0.1, "all handled")
    assert seqs(fleet.records(), POISON_KEY) == list(range(60))
    assert group.parked() == {}


def _publish_seqs(stream: str, rabbitmq: str, registry: Registry, first: int, end: int) -> None:
    """POISON_KEY's messages ``first`` … ``end - 1``, about 200 a second, confirmed."""
    with Producer(stream, amqp_url=rabbitmq, etcd=registry) as producer:
        for seq in range(first, end):
            producer.publish(POISON_KEY, json.dumps({"seq": seq}).encode(), message_id=f"p:{seq}")
            time.sleep(0.005)
        producer.flush(30)

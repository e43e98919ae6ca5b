"""Dead letters listed in place, redriven in order and purged by key, on real etcd and
RabbitMQ, with the dead-letter queue classic and quorum.

Given a ``dead-letter`` stream whose consumer fails every message of three keys, when an
operator lists and shows the dead letters, then each is there with its error and stays in
the queue (same count, same order); when one key is redriven after the fix, its messages
are handled in their original order and only they leave the queue; when another key is
purged, only its dead letters go; and a redrive of all puts the rest back, in order, and
empties the queue.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import pytest
from partq.coordinator.ops import admin, deadletters, dlq
from partq.coordinator.store.group import Group
from partq.producer import Producer, StreamSpec
from partq.producer.contract import (
    HEADER_ERROR,
    HEADER_ERROR_TYPE,
    HEADER_FAILED_PARTITION,
    QueueType,
    encode_key,
)
from partq.producer.registry import Registry

from partq.kernel.errors import UsageError
from partq.kernel.settings import Settings

from .groups.harness import PARTQ, ROOT, Fleet, balanced, wait_until

pytestmark = [pytest.mark.integration]

P = 4
POISONED = ("key-a", "key-b", "key-d")
FINE = "key-c"
PER_KEY = 6


@pytest.fixture(params=["quorum", "classic"])
def fleet(
    request: pytest.FixtureRequest, quorum_fleet: Callable[..., Fleet]
) -> tuple[Fleet, StreamSpec]:
    queue_type: QueueType = request.param
    fleet = quorum_fleet(P, "dead-letter", queue_type)
    return fleet, StreamSpec(fleet.stream, P, queue_type, on_failure="dead-letter")


def partq(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(PARTQ), *args], env=fleet._env(), cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


def listed(fleet: Fleet) -> list[dict[str, Any]]:
    doc = json.loads(partq(fleet, "dlq", "list", fleet.stream, "--json").stdout)
    letters: list[dict[str, Any]] = doc["dead_letter_messages"]
    assert doc["dead_letters"] == len(letters)
    return letters


def ids(letters: list[dict[str, Any]]) -> list[str]:
    return [d["message_id"] for d in letters]


def handled(fleet: Fleet, key: str) -> list[int]:
    return [r["seq"] for r in fleet.records() if r["key"] == key]


def test_dead_letters_are_listed_in_place_then_redriven_and_purged_by_key(
    fleet: tuple[Fleet, StreamSpec], registry: Registry, rabbitmq: str, tmp_path: Path
) -> None:
    fleet_, spec = fleet
    flag = tmp_path / "poisoned"
    flag.touch()
    fleet_.env.update(
        PARTQ_POISON_KEY=",".join(POISONED), PARTQ_POISON_SEQ="0", PARTQ_POISON_FLAG=str(flag)
    )
    group = Group(registry.client, registry.where, fleet_.stream)
    fleet_.coordinator(settle=0.5)
    fleet_.consumer("c1", handler="poison_key", extra=("--max-attempts", "1"))
    wait_until(lambda: balanced(group, P, {"c1"}), 30, 0.1, "balanced")
    # Given every message of three keys dead-lettered, interleaved with a key that works
    with Producer(spec, amqp_url=rabbitmq) as producer:
        for seq in range(PER_KEY):
            for key in (*POISONED, FINE):
                body = json.dumps({"seq": seq}).encode()
                producer.publish(key, body, message_id=f"{key}:{seq}")
        producer.flush(30)
    dead = len(POISONED) * PER_KEY
    wait_until(lambda: dlq.dead_letter_depth(rabbitmq, spec) == dead, 30, 0.2, "dead letters")
    wait_until(lambda: len(handled(fleet_, FINE)) == PER_KEY, 30, 0.2, "the fine key handled")

    # When they are listed, twice
    first = listed(fleet_)
    second = listed(fleet_)
    # Then each shows its key, error, attempts, partition, member and time, per key in order
    assert len(first) == dead
    for key in POISONED:
        assert [i for i in ids(first) if i.startswith(key)] == [
            f"{key}:{s}" for s in range(PER_KEY)
        ]
    for d in first:
        assert d["error_type"] == "ValueError"
        assert f"poisoned message {d['message_id']}" in d["error"]
        assert d["attempts"] == 1
        assert d["member"] == "c1"
        assert d["partition"] == spec.partition_for(d["key"])
        assert d["failed_ms"] > 0
    # And they stay in the queue: same count, same order
    assert ids(second) == ids(first)
    assert dlq.dead_letter_depth(rabbitmq, spec) == dead
    shown = json.loads(
        partq(fleet_, "dlq", "show", fleet_.stream, "--key", "key-a", "--json").stdout
    )
    assert ids(shown["dead_letter_messages"]) == [f"key-a:{s}" for s in range(PER_KEY)]
    assert ids(listed(fleet_)) == ids(first)
    # And reading more often than RabbitMQ 4's default delivery limit (20) loses none
    for _ in range(21):
        deadletters.read(rabbitmq, spec)
    assert ids(listed(fleet_)) == ids(first)

    # When the handler is fixed and key-a's dead letters redriven
    flag.unlink()
    done = partq(fleet_, "dlq", "redrive", fleet_.stream, "--dead-letters", "--key", "key-a")
    assert f"{PER_KEY} dead letters of key 'key-a' redriven" in done.stdout
    # Then they are handled in their original order, and only they left the queue
    wait_until(lambda: len(handled(fleet_, "key-a")) == PER_KEY, 30, 0.2, "key-a handled")
    assert handled(fleet_, "key-a") == list(range(PER_KEY))
    assert ids(listed(fleet_)) == [i for i in ids(first) if not i.startswith("key-a")]

    # When key-b's dead letters are purged
    partq(fleet_, "dlq", "purge", fleet_.stream, "--dead-letters", "--key", "key-b", "--yes")
    # Then only key-d's remain, in order
    assert ids(listed(fleet_)) == [i for i in ids(first) if i.startswith("key-d")]

    # When every dead letter is redriven
    partq(fleet_, "dlq", "redrive", fleet_.stream, "--dead-letters")
    # Then key-d's are handled in order, the queue is empty, key-b's were never handled
    wait_until(lambda: len(handled(fleet_, "key-d")) == PER_KEY, 30, 0.2, "key-d handled")
    assert handled(fleet_, "key-d") == list(range(PER_KEY))
    assert dlq.dead_letter_depth(rabbitmq, spec) == 0
    assert handled(fleet_, "key-b") == []


def test_a_second_reader_is_refused_while_one_holds_the_queue(
    quorum_fleet: Callable[..., Fleet], rabbitmq: str
) -> None:
    # Given two dead letters, one held by another reader
    fleet = quorum_fleet(P, "dead-letter")
    spec = StreamSpec(fleet.stream, P, "quorum", on_failure="dead-letter")
    with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        for body in (b"x", b"y"):
            channel.basic_publish(spec.dead_letter_exchange, spec.dead_letter_queue, body)
        holder = connection.channel()
        holder.basic_qos(prefetch_count=1)
        holder.basic_consume(spec.dead_letter_queue, lambda *_a: None)
        # When another reads; Then it is told to wait its turn, and nothing is taken
        with pytest.raises(UsageError, match="another consumer is reading"):
            deadletters.read(rabbitmq, spec)
        holder.close()
    assert dlq.dead_letter_depth(rabbitmq, spec) == 2


def test_a_command_that_looks_at_part_of_the_queue_says_how_much(
    registry: Registry, settings: Settings, rabbitmq: str, stream_name: str
) -> None:
    # Given 50 dead letters, every fifth of key "k" (10 of them), and commands looking at
    # 20 at most (--limit: the same logic as the default of 10,000, on a small queue). A
    # classic queue: the order of what a keyed command gives back is not this test's subject
    spec = StreamSpec(stream_name, P, "classic", on_failure="dead-letter")
    admin.create_stream(registry, rabbitmq, spec)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PARTQ_")}
    environ |= {"PARTQ_ETCD_ENDPOINTS": settings.etcd_endpoints, "PARTQ_AMQP_URL": rabbitmq}

    def run(*args: str) -> str:
        done = subprocess.run(
            [str(PARTQ), "dlq", *args], env=environ, cwd=ROOT, capture_output=True,
            text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        with pika.BlockingConnection(pika.URLParameters(rabbitmq)) as connection:
            channel = connection.channel()
            channel.confirm_delivery()
            for i in range(50):
                headers = {
                    **encode_key("k" if i % 5 == 0 else f"other-{i}"),
                    HEADER_ERROR_TYPE: "ValueError",
                    HEADER_ERROR: "ValueError: poison key",
                    HEADER_FAILED_PARTITION: 0,
                }
                properties = pika.BasicProperties(headers=headers, message_id=str(i))
                channel.basic_publish(spec.dead_letter_exchange, spec.dead_letter_queue, b"x",
                                      properties)  # fmt: skip
        looked = "looked at the first 20 of 50 dead letters in " + spec.dead_letter_queue
        # When the key is shown, looking at 20
        shown = run("show", stream_name, "--key", "k", "--limit", "20")
        # Then it counts the key's among those 20, and says the other 30 were not looked at
        assert "dead letters of this key among the first 20 in" in shown
        assert shown.count("ValueError: poison key") == 4
        assert f"{looked}; the other 30 were not looked at: use --limit N" in shown
        doc = json.loads(run("show", stream_name, "--key", "k", "--limit", "20", "--json"))
        assert (doc["dead_letters"], doc["dead_letters_looked_at"]) == (50, 20)
        # When the key's dead letters are purged, looking at 20 it keeps
        purged = run("purge", stream_name, "--dead-letters", "--key", "k", "--limit", "20",
                     "--yes")  # fmt: skip
        # Then it says how many it looked at (the 20 kept and the 5 purged), claiming no count
        # of what is left of the key
        assert "5 dead letters of key 'k' purged; looked at the first 25 of 50" in purged
        assert "left" not in purged
        # When it looks at the whole queue
        purged = run("purge", stream_name, "--dead-letters", "--key", "k", "--yes")
        # Then the rest of the key's go, and what is left is counted
        assert f"5 dead letters of key 'k' purged; 40 left in {spec.dead_letter_queue}" in purged
        letters = deadletters.read(rabbitmq, spec).letters
        assert [d.message_id for d in letters] == [str(i) for i in range(50) if i % 5]
    finally:
        admin.delete(registry, rabbitmq, stream_name)

"""The pure parts of reading and redriving dead letters: headers in, a DeadLetter out; what
a redrive publishes and where; the DLQ's arguments per broker version."""

from __future__ import annotations

import pika
from partq.coordinator.ops.deadletters import letter_from, republished, target
from partq.producer.contract import DEAD_LETTER_HEADERS, StreamSpec
from partq.producer.queue_arguments import dead_letter_queue_arguments

SPEC = StreamSpec("orders", 8, "quorum")


def dead(headers: dict[str, object], message_id: str | None = "m1") -> pika.BasicProperties:
    return pika.BasicProperties(headers=headers, message_id=message_id, delivery_mode=2)


FAILED = {
    "partq-key": "k1",
    "partq-partition": SPEC.partition_for("k1"),
    "partq-published-ms": 5,
    "x-partq-error": "ValueError: no",
    "x-partq-error-type": "ValueError",
    "x-partq-attempts": 5,
    "x-partq-partition": SPEC.partition_for("k1"),
    "x-partq-member": "c1",
    "x-partq-failed-ms": 1_700_000_000_000,
    "x-delivery-count": 3,
    "x-death": [{"count": 1}],
}


def test_a_dead_letter_reads_its_headers() -> None:
    # Given a message the consumer dead-lettered; When read
    d = letter_from(4, dead(FAILED), b"body")
    # Then every field comes from its header
    assert (d.position, d.key, d.partition, d.error_type, d.error) == (
        4, "k1", SPEC.partition_for("k1"), "ValueError", "ValueError: no",
    )  # fmt: skip
    assert (d.attempts, d.member, d.failed_ms, d.size, d.returns) == (
        5, "c1", 1_700_000_000_000, 4, 3,
    )  # fmt: skip
    assert d.matches("k1") and d.matches(b"k1") and d.matches(None) and not d.matches("k2")


def test_malformed_or_missing_headers_read_as_missing() -> None:
    # Given a foreign message with hostile values; When read; Then nothing raises
    d = letter_from(0, dead({"partq-key-b64": "%%%", "x-partq-attempts": "many"}, None), b"")
    assert (d.key, d.attempts, d.partition, d.message_id, d.key_text) == (
        None, None, None, None, None,
    )  # fmt: skip
    assert not d.matches("k1")
    # And a binary key is shown as b64
    assert letter_from(0, dead({"partq-key-b64": "/w=="}), b"").key_text == "b64:/w=="


def test_a_redrive_drops_the_bookkeeping_and_keeps_the_rest() -> None:
    properties = republished(dead(FAILED), "default")
    assert properties.headers == {
        "partq-key": "k1",
        "partq-partition": SPEC.partition_for("k1"),
        "partq-published-ms": 5,
        "x-partq-group": "default",  # the other groups' consumers drop their copies
    }
    assert properties.message_id == "m1" and properties.delivery_mode == 2
    assert not set(DEAD_LETTER_HEADERS) & set(properties.headers)


def test_a_redrive_routes_by_key_else_by_the_failed_partition() -> None:
    assert target(SPEC, letter_from(0, dead({"partq-key": "k9"}), b"")) == SPEC.partition_for("k9")
    assert target(SPEC, letter_from(0, dead({"x-partq-partition": 3}), b"")) == 3
    assert target(SPEC, letter_from(0, dead({"x-partq-partition": 99}), b"")) is None
    assert target(SPEC, letter_from(0, dead({}), b"")) is None
    # And a control request the consumer refused is never replayed
    refused = {"partq-key": "k9", "x-partq-control": "purge"}
    assert target(SPEC, letter_from(0, dead(refused), b"")) is None


def test_a_quorum_dlq_has_no_delivery_limit_on_rabbitmq_4_only() -> None:
    assert dead_letter_queue_arguments(SPEC, 4)["x-delivery-limit"] == -1
    assert "x-delivery-limit" not in dead_letter_queue_arguments(SPEC, 3)  # -1 drops there
    classic = StreamSpec("orders", 8, "classic")
    assert dead_letter_queue_arguments(classic, 4) == {"x-queue-type": "classic"}

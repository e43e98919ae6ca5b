"""What a handler sees: keys, attempts, and the replay ids of Spark-published messages."""

from __future__ import annotations

from consumers.message import message_from
from producer.contract import encode_key
from producer.spark.replay import ReplayId


def test_spark_replays_are_identifiable_from_the_message() -> None:
    # Given a message the Spark sink published (its headers as pika decodes them)
    replay = ReplayId("q-1", 7, 3, 41)
    headers = {**encode_key("user-1"), **replay.headers(), "partq-query-id": b"q-1"}
    message = message_from("orders", 3, b"{}", replay.message_id, headers, True, 1)
    # Then the handler gets the parts, and they rebuild the message id
    assert message.replay == replay
    assert message.replay is not None and message.replay.message_id == message.message_id
    assert message.key == "user-1"


def test_other_messages_have_no_replay_and_attempts_count_broker_deliveries() -> None:
    message = message_from("orders", 0, b"x", "id", {"x-delivery-count": 2}, True, 1)
    assert message.replay is None
    assert message.attempt == 3

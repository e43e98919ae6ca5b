"""What a handler sees: keys, attempts, and the replay ids of Spark-published messages."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from partq.consumers.handling.message import (
    MalformedHeaders,
    Message,
    check_handler,
    load_handler,
    message_from,
)
from partq.producer.contract import encode_key
from partq.producer.spark.replay import ReplayId

from partq.kernel.errors import UsageError


def test_spark_replays_are_identifiable_from_the_message() -> None:
    # Given a message the Spark sink published (its headers as pika decodes them)
    replay = ReplayId("q-1", 7, 3, 41)
    headers = {**encode_key("user-1"), **replay.headers(), "partq-query-id": b"q-1"}
    message = message_from("orders", 3, b"{}", replay.message_id, headers, True, 1)
    # Then the handler gets the parts, and they rebuild the message id
    assert message.replay == replay
    assert message.replay is not None and message.replay.message_id == message.message_id
    assert message.key == "user-1"


def test_attempts_count_handler_attempts_and_the_broker_count_is_apart() -> None:
    # Given a delivery the broker delivered twice before (a crash, or a handoff's return)
    message = message_from("orders", 0, b"x", "id", {"x-delivery-count": 2}, True, 1)
    # Then those deliveries do not spend the handler's attempts: they are reported apart
    assert message.replay is None
    assert message.attempt == 1
    assert message.delivery_count == 2
    assert message_from("orders", 0, b"x", "id", {}, False, 3).delivery_count == 0


def test_a_message_without_partq_headers_is_a_message() -> None:
    # A foreign publisher's message: no key, no timestamp, still handled
    message = message_from("orders", 2, b"x", None, None, False, 1)
    assert (message.key, message.published_ms, message.published_partition) == (None, None, None)


def test_partq_headers_are_parsed() -> None:
    headers = {
        **encode_key(b"\x00\xff"),
        "partq-published-ms": 1_700_000_000_000,
        "partq-partition": 4,
        "x-delivery-count": 1,
    }
    message = message_from("orders", 3, b"x", "id", headers, True, 2)
    assert message.key == b"\x00\xff"
    assert message.published_ms == 1_700_000_000_000
    assert message.published_partition == 4  # not 3: the worker logs and counts it
    assert (message.attempt, message.delivery_count) == (2, 1)
    # decimal strings (another language's producer) are accepted
    text = message_from("o", 0, b"", None, {"partq-published-ms": "17"}, False, 1)
    assert text.published_ms == 17


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("partq-published-ms", "yesterday"),
        ("partq-published-ms", -5),
        ("partq-published-ms", True),
        ("partq-published-ms", 1.5),
        ("partq-partition", "three"),
        ("partq-key-b64", "not*base64!"),
        ("partq-key-b64", "abc"),  # bad padding
        ("partq-key-b64", 7),
        ("partq-key", b"\xff\xfe"),  # not UTF-8
        ("partq-key", 42),
        ("partq-seq", "x"),
        ("partq-batch-id", None),
    ],
)
def test_a_malformed_partq_header_is_refused_naming_header_and_value(
    header: str, value: object
) -> None:
    with pytest.raises(MalformedHeaders) as raised:
        message_from("orders", 0, b"x", "id", {header: value}, False, 1)
    assert raised.value.header == header
    assert header in str(raised.value) and repr(value) in str(raised.value)


async def _async_handler(message: Message) -> None:
    pass


async def _async_generator(message: Message) -> Any:
    yield message


class _AsyncCall:
    async def __call__(self, message: Message) -> None:
        pass


class _SyncCall:
    def __call__(self, message: Message) -> None:
        pass


def _sync_handler(message: Message, extra: int = 0) -> None:
    pass


class _AsyncGeneratorCall:
    async def __call__(self, message: Message) -> Any:
        yield message


def _sync_generator(message: Message) -> Any:
    yield message


class _SyncGeneratorCall:
    def __call__(self, message: Message) -> Any:
        yield message


@pytest.mark.parametrize(
    "handler",
    [
        _async_handler,
        _AsyncCall(),
        functools.partial(_async_handler),
        functools.partial(functools.partial(_AsyncCall())),
    ],
    ids=["async-def", "async-call", "partial", "partial-of-partial-object"],
)
def test_an_asynchronous_handler_is_accepted(handler: Any) -> None:
    assert check_handler(handler) is handler


@pytest.mark.parametrize(
    ("handler", "kind"),
    [
        (_async_generator, "an async generator"),
        (_AsyncGeneratorCall(), "an async generator"),
        (functools.partial(_async_generator), "an async generator"),
        # issue 43, item 8: calling one only makes a generator, so every message was acked unrun
        (_sync_generator, "a generator"),
        (_SyncGeneratorCall(), "a generator"),
        (functools.partial(_sync_generator), "a generator"),
    ],
    ids=[
        "async-generator",
        "async-generator-call",
        "partial",
        "sync-generator",
        "sync-generator-call",
        "sync-partial",
    ],
)
def test_a_generator_handler_is_refused_in_one_line(handler: Any, kind: str) -> None:
    with pytest.raises(UsageError) as refused:
        check_handler(handler)
    assert f" is {kind} " in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "handler", [_sync_handler, _SyncCall(), functools.partial(_sync_handler, extra=1), print]
)
def test_a_synchronous_handler_is_accepted(handler: Any) -> None:
    assert check_handler(handler) is handler


def test_load_handler_loads_an_asynchronous_handler() -> None:
    assert load_handler("tests.unit.test_message:_async_handler") is _async_handler


def test_load_handler_refuses_an_async_generator() -> None:
    with pytest.raises(UsageError, match=r"test_message:_async_generator is an async generator"):
        load_handler("tests.unit.test_message:_async_generator")


def test_load_handler_refuses_a_sync_generator() -> None:
    with pytest.raises(UsageError, match=r"test_message:_sync_generator is a generator"):
        load_handler("tests.unit.test_message:_sync_generator")

"""The pure parts of partq.producer.spark: option parsing, replay ids, failure text, the surface."""

from __future__ import annotations

import importlib
import types
from dataclasses import replace

import partq.producer.spark
import pytest
from partq.producer.contract import StreamSpec
from partq.producer.spark import options as options_module
from partq.producer.spark.options import DEFAULT_SPEC_READER, SinkOptions, resolve_spec_reader
from partq.producer.spark.progress import failure_reason
from partq.producer.spark.replay import ReplayId, message_id
from partq.producer.spark.rows import GROUPED_BY, PARTITION_COLUMN, POSITION_COLUMN, RowLayout
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

from partq.kernel.errors import EtcdUnavailable, PartqError, SpecMismatch, UsageError

pytestmark = pytest.mark.spark


def test_the_public_surface_is_exactly_what_all_names() -> None:
    assert sorted(partq.producer.spark.__all__) == sorted(partq.producer.spark._HOME)
    for name in partq.producer.spark.__all__:
        value = getattr(partq.producer.spark, name)
        assert not isinstance(value, types.ModuleType), f"{name} is shadowed by a module"
    with pytest.raises(AttributeError):
        partq.producer.spark.nothing_here  # noqa: B018


def test_options_round_trip_through_spark_style_options() -> None:
    # Given options as a user writes them, names in any case
    given = {"STREAM": "orders", "keycolumn": "user_id", "Window": "50", "partitions": "8"}
    # When parsed and turned back into options
    options = SinkOptions.from_options(given)
    # Then nothing is lost and the defaults are the documented ones
    assert (options.stream, options.key_column, options.window, options.partitions) == (
        "orders",
        "user_id",
        50,
        8,
    )
    assert options.spec_reader == DEFAULT_SPEC_READER
    assert SinkOptions.from_options(options.to_options()) == options


def test_the_amqp_tls_settings_round_trip_with_the_url() -> None:
    # Given options whose RabbitMQ target has TLS settings (as `partq spark-job` gives)
    from pathlib import Path

    from partq.kernel.amqp import AmqpTarget, AmqpTLS

    tls = AmqpTLS(Path("/ca.pem"), Path("/c.pem"), Path("/c.key"), external_auth=True)
    options = SinkOptions("orders", "k", amqp_url=AmqpTarget("amqps://u:pw@h/%2F", tls))
    # When turned into Spark options (what reaches the executors) and back
    spark_options = options.to_options()
    # Then the URL is whole (not the redacted str()) and the TLS settings travel with it
    assert spark_options["amqpUrl"] == "amqps://u:pw@h/%2F"
    assert spark_options["amqpCa"] == "/ca.pem"
    assert SinkOptions.from_options(spark_options) == options


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"keyColumn": "k"}, "option stream is required"),
        ({"stream": "orders"}, "option keyColumn is required"),
        (
            {"stream": "orders", "keyColumn": "k", "window": "many"},
            "option window must be a number",
        ),
        ({"stream": "orders", "keyColumn": "k", "window": "0"}, "window must be at least 1"),
        ({"stream": "Orders!", "keyColumn": "k"}, "invalid stream name"),
        ({"stream": "orders", "keyColumn": "k", "queryId": "a:b"}, "queryId"),
    ],
)
def test_bad_options_are_refused_naming_the_option(given: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        SinkOptions.from_options(given)


def test_the_amqp_password_stays_out_of_repr() -> None:
    options = SinkOptions("orders", "k", amqp_url="amqp://u:secret@host:5672/%2F")
    assert "secret" not in repr(options)
    assert "u:***@host" in repr(options)


def test_a_pinned_spec_is_checked_against_the_stream_and_partitions() -> None:
    spec = StreamSpec("orders", 8).to_json()
    assert SinkOptions("orders", "k", spec=spec).read_spec() == StreamSpec("orders", 8)
    with pytest.raises(SpecMismatch, match="has 8 partitions in etcd, but option partitions=4"):
        SinkOptions("orders", "k", spec=spec, partitions=4).read_spec()
    with pytest.raises(UsageError, match="describes stream 'orders', not 'payments'"):
        SinkOptions("payments", "k", spec=spec).read_spec()


def test_the_spec_reader_is_resolved_by_name() -> None:
    reader = resolve_spec_reader(DEFAULT_SPEC_READER)
    assert reader is importlib.import_module("partq.producer.registry").read_spec_from_endpoints
    with pytest.raises(UsageError, match="cannot import nowhere"):
        resolve_spec_reader("nowhere.at_all:read")
    with pytest.raises(UsageError, match="has no function missing"):
        resolve_spec_reader("partq.producer.registry:missing")
    with pytest.raises(UsageError, match="must look like"):
        resolve_spec_reader("partq.producer.registry")


def test_replay_ids_are_deterministic_and_parse_back() -> None:
    replay = ReplayId("9f1c", batch_id=12, partition=3, seq=41)
    assert replay.message_id == message_id("9f1c", 12, 3, 41) == "9f1c:12:3:41"
    assert ReplayId.parse(replay.message_id) == replay
    assert replay.headers() == {"partq-query-id": "9f1c", "partq-batch-id": 12, "partq-seq": 41}
    with pytest.raises(ValueError, match="not a partq Spark message id"):
        ReplayId.parse("a-uuid-from-the-sdk")


def test_the_partq_error_is_found_in_a_spark_failure() -> None:
    text = (
        "[STREAM_FAILED] Query [id = 1] terminated with exception: Job aborted.\n"
        "Traceback (most recent call last):\n"
        '  File "publish.py", line 80, in publish_task\n'
        "partq.kernel.errors.BrokerUnavailable: cannot reach RabbitMQ at amqp://g:***@h:1/: is it "
        "running?\n\tat org.apache.spark.api.python.BasePythonRunner"
    )
    assert failure_reason(text) == (
        "BrokerUnavailable: cannot reach RabbitMQ at amqp://g:***@h:1/: is it running?"
    )
    assert failure_reason("java.lang.OutOfMemoryError\n\tat x") == "java.lang.OutOfMemoryError"


# A spec reader for the tests below ("module:function", as option specReader names one):
# what etcd holds now, or the error reading it raises.
_ETCD: list[StreamSpec | PartqError] = []


def etcd_now(stream: str, endpoints: str) -> StreamSpec:
    now = _ETCD[-1]
    if isinstance(now, PartqError):
        raise now
    return now


def test_each_batch_takes_the_newest_layout_and_a_pinned_one_while_etcd_is_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a spec pinned at epoch 0 with 8 partitions
    options = SinkOptions(
        "orders", "k", partitions=8, spec_reader="tests.spark.test_surface:etcd_now"
    )
    _ETCD[:] = [StreamSpec("orders", 8)]
    monkeypatch.setattr(options_module, "_unanswered", {})
    monkeypatch.setattr(options_module, "_newest", {})
    pinned = options.pinned()
    grown = replace(StreamSpec("orders", 16), epoch=1)
    # When etcd answers with the pinned layout, a batch publishes under it
    assert pinned.current_spec() == StreamSpec("orders", 8)
    # When etcd is away, under the pinned one, and etcd is not asked again for 30 s
    _ETCD.append(EtcdUnavailable("etcd at 127.0.0.1:1 is unavailable"))
    assert pinned.current_spec() == StreamSpec("orders", 8)
    _ETCD.append(grown)
    assert pinned.current_spec() == StreamSpec("orders", 8)
    # When the 30 s have passed and etcd holds a resize's layout, under that one
    monkeypatch.setattr(options_module, "_unanswered", {})
    assert pinned.current_spec() == grown
    # When etcd is away again, under the newest layout read, not the pinned one
    _ETCD.append(EtcdUnavailable("etcd at 127.0.0.1:1 is unavailable"))
    monkeypatch.setattr(options_module, "_unanswered", {})
    assert pinned.current_spec() == grown
    # The strict start-up read is still the pinned spec (the option's count was the
    # query's, at its start)
    assert pinned.read_spec() == StreamSpec("orders", 8)
    # and a stream never resized is still held to the option
    _ETCD.append(StreamSpec("orders", 4))
    with pytest.raises(SpecMismatch, match="has 4 partitions in etcd, but option partitions=8"):
        replace(options, spec=None).current_spec()


def _prepared_schema(grouped_by: int | None) -> StructType:
    metadata = {} if grouped_by is None else {GROUPED_BY: grouped_by}
    return StructType(
        [
            StructField("k", StringType()),
            StructField(PARTITION_COLUMN, IntegerType(), metadata=metadata),
            StructField(POSITION_COLUMN, LongType()),
        ]
    )


def test_rows_grouped_for_an_older_layout_are_taken_only_by_a_resized_stream() -> None:
    options = SinkOptions("orders", "k")
    resized = replace(StreamSpec("orders", 16), epoch=1)
    # A query prepared for 8 partitions publishes to the stream resized to 16 under it
    assert RowLayout.from_schema(_prepared_schema(8), options, resized).partitions == 8
    # but not to a stream never resized with another count: nothing is published
    with pytest.raises(SpecMismatch, match="grouped the rows by 8 partitions, but stream"):
        RowLayout.from_schema(_prepared_schema(8), options, StreamSpec("orders", 4))
    # nor against the option's expectation
    with pytest.raises(SpecMismatch, match="but option partitions=4 expects 4"):
        RowLayout.from_schema(_prepared_schema(8), replace(options, partitions=4), resized)
    # A column without the metadata is taken as the spec's count (checked per row)
    assert RowLayout.from_schema(_prepared_schema(None), options, resized).partitions == 16
    with pytest.raises(UsageError, match="malformed metadata"):
        RowLayout.from_schema(_prepared_schema(0), options, resized)

"""The partq sink and the foreachBatch writer on a real local Spark, etcd and RabbitMQ."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pytest
from partq.producer.contract import StreamSpec, decode_key, partition_for
from partq.producer.spark import (
    HEADER_BATCH_ID,
    HEADER_QUERY_ID,
    HEADER_SEQ,
    ReplayId,
    SinkOptions,
    failure_reason,
    foreach_batch_writer,
    prepare,
)
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession

from partq.kernel.settings import Settings
from tests.spark.conftest import (
    ROW_SCHEMA,
    Delivered,
    committed_batches,
    keyed_rows,
    queue_depths,
    read_all,
    write_json_rows,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROWS = 20_000
KEYS = 500
FILES = 8


def _source(spark: SparkSession, directory: Path) -> DataFrame:
    return (
        spark.readStream.schema(ROW_SCHEMA)
        .option("maxFilesPerTrigger", FILES // 2)
        .json(str(directory))
    )


def _check_every_row_once_in_order(
    spec: StreamSpec, queues: dict[int, list[Delivered]], query_id: str, rows: int = ROWS
) -> None:
    delivered = [m for partition in sorted(queues) for m in queues[partition]]
    # Each row exactly once.
    orders = Counter(m.row["order"] for m in delivered)
    assert sorted(orders) == list(range(rows)), "rows missing"
    assert max(orders.values()) == 1, "rows duplicated although nothing failed"
    assert len({m.message_id for m in delivered}) == rows
    seqs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for partition, messages in queues.items():
        last_order: dict[str | bytes, int] = {}
        for m in messages:
            key = decode_key(m.headers)
            assert key is not None
            # In the queue partq's hash names.
            assert partition_for(key, spec.partitions) == partition
            assert m.row["order"] % KEYS == int(str(key).removeprefix("user-"))
            # In per-key order.
            assert m.row["order"] > last_order.get(key, -1), f"key {key!r} out of order"
            last_order[key] = m.row["order"]
            # With a deterministic id whose parts are in the headers.
            replay = ReplayId.parse(m.message_id)
            assert (replay.query_id, replay.partition) == (query_id, partition)
            assert m.headers[HEADER_QUERY_ID] == query_id
            assert (m.headers[HEADER_BATCH_ID], m.headers[HEADER_SEQ]) == (
                replay.batch_id,
                replay.seq,
            )
            seqs[(replay.batch_id, partition)].append(replay.seq)
    for (batch, partition), numbers in seqs.items():
        assert numbers == list(range(len(numbers))), f"batch {batch} partition {partition}"
    assert len({batch for batch, _ in seqs}) == 2, "expected two micro-batches"


def test_sink_publishes_every_row_to_its_partition_in_key_order(
    spark: SparkSession, spark_stream: StreamSpec, settings: Settings, tmp_path: Path
) -> None:
    # Given 20 000 rows of 500 keys spread over 8 JSON files
    write_json_rows(tmp_path / "in", keyed_rows(ROWS, KEYS), FILES)
    options = SinkOptions(
        stream=spark_stream.name,
        key_column="key",
        etcd_endpoints=settings.etcd_endpoints,
        amqp_url=settings.amqp,
        partitions=spark_stream.partitions,
    )
    # When a streaming query writes them with format("partq"), reading the spec from etcd
    prepared = prepare(_source(spark, tmp_path / "in"), spark_stream, "key", "order")
    query = (
        prepared.writeStream.format("partq")
        .options(**options.to_options())
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(180), "the query did not finish"
    assert query.exception() is None
    # Then every row is in the queue partition_for names, once, in per-key order
    _check_every_row_once_in_order(spark_stream, read_all(settings.amqp, spark_stream), query.id)
    assert committed_batches(tmp_path / "chk") == [0, 1]


def test_foreach_batch_writer_keeps_the_same_contract(
    spark: SparkSession, spark_stream: StreamSpec, settings: Settings, tmp_path: Path
) -> None:
    # Given rows like those above (fewer: the same code publishes them)
    rows = 8_000
    write_json_rows(tmp_path / "in", keyed_rows(rows, KEYS), FILES)
    # When foreachBatch publishes them
    writer = foreach_batch_writer(
        spark_stream.name,
        key_column="key",
        order_column="order",
        etcd_endpoints=settings.etcd_endpoints,
        amqp_url=settings.amqp,
    )
    query = (
        _source(spark, tmp_path / "in")
        .writeStream.foreachBatch(writer)
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(180), "the query did not finish"
    assert query.exception() is None
    # Then the contract holds as for the format
    queues = read_all(settings.amqp, spark_stream)
    _check_every_row_once_in_order(spark_stream, queues, query.id, rows)


def _failing_query(
    spark: SparkSession, spec: StreamSpec, tmp_path: Path, **overrides: object
) -> tuple[str, Path]:
    write_json_rows(tmp_path / "in", keyed_rows(1_000, 50), 2)
    options = {
        "stream": spec.name,
        "keyColumn": "key",
        **{k: str(v) for k, v in overrides.items()},
    }
    checkpoint = tmp_path / "chk"
    query = (
        prepare(_source(spark, tmp_path / "in"), spec, "key", "order")
        .writeStream.format("partq")
        .options(**options)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    with pytest.raises(StreamingQueryException) as failure:
        query.awaitTermination(120)
    return str(failure.value), checkpoint


def test_a_spec_mismatch_fails_the_query_before_anything_is_published(
    spark: SparkSession, spark_stream: StreamSpec, settings: Settings, tmp_path: Path
) -> None:
    # Given a sink configured for 3 partitions of an 8-partition stream
    # When the query runs
    error, checkpoint = _failing_query(
        spark,
        spark_stream,
        tmp_path,
        etcdEndpoints=settings.etcd_endpoints,
        amqpUrl=settings.amqp.url,
        partitions=3,
    )
    # Then it fails, saying so, and nothing was published or committed
    assert failure_reason(error).startswith("SpecMismatch: stream "), error
    assert "has 8 partitions in etcd, but option partitions=3" in failure_reason(error)
    assert queue_depths(settings.amqp, spark_stream) == [0] * spark_stream.partitions
    assert committed_batches(checkpoint) == []


def test_an_unreachable_broker_fails_the_query_and_commits_nothing(
    spark: SparkSession, spark_stream: StreamSpec, settings: Settings, tmp_path: Path
) -> None:
    from partq.kernel.local import free_port

    # Given a sink pointed at a port where no broker listens
    closed = f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F"
    # When the query runs
    error, checkpoint = _failing_query(
        spark, spark_stream, tmp_path, etcdEndpoints=settings.etcd_endpoints, amqpUrl=closed
    )
    # Then it fails with partq's error naming the broker (password hidden), nothing committed
    reason = failure_reason(error)
    assert reason.startswith(
        "BrokerUnavailable: cannot reach RabbitMQ at amqp://guest:***@127.0.0.1"
    )
    assert "guest:guest" not in error
    assert committed_batches(checkpoint) == []
    assert queue_depths(settings.amqp, spark_stream) == [0] * spark_stream.partitions


def test_without_an_order_column_rows_keep_source_order_across_input_splits(
    spark: SparkSession, spark_stream: StreamSpec, settings: Settings, tmp_path: Path
) -> None:
    # Given one file that Spark reads as about ten splits (map tasks) of one micro-batch
    rows = keyed_rows(5_000, 50)
    write_json_rows(tmp_path / "in", rows, 1)
    spark.conf.set("spark.sql.files.maxPartitionBytes", "32k")
    try:
        source = spark.readStream.schema(ROW_SCHEMA).json(str(tmp_path / "in"))
        # When it is published without an order column
        query = (
            prepare(source, spark_stream, "key")
            .writeStream.format("partq")
            .options(
                **SinkOptions(
                    spark_stream.name, "key", amqp_url=settings.amqp, spec=spark_stream.to_json()
                ).to_options()
            )
            .option("checkpointLocation", str(tmp_path / "chk"))
            .trigger(availableNow=True)
            .start()
        )
        assert query.awaitTermination(120), "the query did not finish"
        assert query.exception() is None
        splits = query.lastProgress["sources"][0]
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
    # Then each key's rows are in file order in their queue
    queues = read_all(settings.amqp, spark_stream)
    assert sum(len(q) for q in queues.values()) == len(rows), splits
    for messages in queues.values():
        last: dict[str, int] = {}
        for m in messages:
            key, order = m.headers["partq-key"], m.row["order"]
            assert order > last.get(key, -1), f"{key} out of source order"
            last[key] = order

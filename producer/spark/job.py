"""The Spark Structured Streaming producer job: a file (or rate) source published to a stream.

``partq spark-job`` (:mod:`cli.spark`) parses the command line, reads the
stream's spec once and calls :func:`run_job`; the query itself never reads etcd.
SIGTERM or SIGINT stop the query between writes; a failed query raises the
partq error that failed it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from kernel.errors import PartqError, UsageError
from producer.contract import StreamSpec
from producer.spark.options import SinkOptions
from producer.spark.partitioning import prepare
from producer.spark.progress import ProgressListener, failure_reason
from producer.spark.session import loopback_session

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["RATE_KEYS", "run_job"]

log = logging.getLogger("partq.spark")

RATE_KEYS = 1000  # distinct keys of the synthetic --rate source


def _source(
    spark: SparkSession,
    *,
    source: Path | None,
    fmt: str,
    schema: str | None,
    rate: int | None,
    max_files: int | None,
) -> DataFrame:
    from pyspark.sql import functions as F

    if rate is not None:
        frame = spark.readStream.format("rate").option("rowsPerSecond", rate).load()
        return frame.withColumn("key", F.format_string("key-%d", F.col("value") % RATE_KEYS))
    assert source is not None
    options = {"header": "true"} if fmt == "csv" else {}
    if schema is None:
        if not source.is_dir() or not any(p.is_file() for p in source.iterdir()):
            raise UsageError(
                f"{source} holds no files to infer the schema from: pass --schema, e.g. "
                f"--schema 'user_id STRING, amount DOUBLE, ts TIMESTAMP'"
            )
        reader = (
            spark.readStream.format(fmt)
            .options(**options)
            .schema(spark.read.format(fmt).options(**options).load(str(source)).schema)
        )
    else:
        reader = spark.readStream.format(fmt).options(**options).schema(schema)
    if max_files is not None:
        reader = reader.option("maxFilesPerTrigger", max_files)
    return reader.load(str(source))


class _StopSignal:
    """SIGTERM/SIGINT set an event; the main loop stops the query (py4j is not reentrant)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.received: str | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        self.event.set()


def run_job(
    spec: StreamSpec,
    options: SinkOptions,
    *,
    source: Path | None,
    fmt: str,
    schema: str | None,
    rate: int | None,
    key_column: str,
    order_column: str | None,
    checkpoint: Path,
    once: bool,
    trigger_seconds: float,
    max_files_per_trigger: int | None,
    num_tasks: int | None,
    master: str | None,
    conf: dict[str, str],
) -> None:
    """Run the query until it ends or a stop signal arrives."""
    stream_name = spec.name
    under_spark_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    spark = loopback_session(
        f"partq-spark-job-{stream_name}",
        master=master or (None if under_spark_submit else "local[2]"),
        conf=conf,
    )
    spark.sparkContext.setLogLevel("WARN")
    query_name = f"partq-{stream_name}"
    spark.streams.addListener(ProgressListener(query_name, stream_name))
    frame = _source(
        spark, source=source, fmt=fmt, schema=schema, rate=rate, max_files=max_files_per_trigger
    )
    prepared = prepare(frame, spec, key_column, order_column, num_tasks=num_tasks)
    writer = (
        prepared.writeStream.format("partq")
        .options(**options.to_options())
        .option("checkpointLocation", str(checkpoint))
        .queryName(query_name)
    )
    writer = (
        writer.trigger(availableNow=True)
        if once
        else writer.trigger(processingTime=f"{trigger_seconds} seconds")
    )
    stop = _StopSignal()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        query = writer.start()
        log.info(
            "stream %s: query %s publishing %s to %d partitions (checkpoint %s)",
            stream_name,
            query.id,
            f"{rate} rows/s" if rate else f"{fmt} files from {source}",
            spec.partitions,
            checkpoint,
        )
        while not stop.event.wait(0.5) and query.isActive:
            pass
        if stop.received is not None:
            log.info("stream %s: %s received, stopping the query", stream_name, stop.received)
            query.stop()
        error = query.exception()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        spark.stop()
    if error is not None:
        raise PartqError(f"the Spark query failed: {failure_reason(str(error))}")
    log.info("stream %s: stopped", stream_name)

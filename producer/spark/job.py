"""The Spark Structured Streaming producer job: a file (or rate) source published to a stream.

``partq spark-job`` (:mod:`partq.cli.spark`) parses the command line, reads the
stream's spec, pins it and calls :func:`run_job`; the query reads etcd only for a newer
layout (a resize: ``SinkOptions.current_spec``), and publishes while etcd is away.
SIGTERM or SIGINT stop the query between writes, or, during Spark's start-up,
stop the session before a query starts; a failed query raises the partq error
that failed it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from partq.producer.contract import StreamSpec
from partq.producer.spark.options import SinkOptions
from partq.producer.spark.partitioning import prepare
from partq.producer.spark.progress import ProgressListener, failure_reason
from partq.producer.spark.session import loopback_session
from partq.producer.spark.stop import StopSignal

from partq.kernel.errors import PartqError, UsageError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.readwriter import DataStreamWriter

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
    stop: StopSignal,
) -> None:
    """Run the query until it ends or ``stop`` is signalled (also during start-up)."""
    stream_name = spec.name
    under_spark_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    log.info("stream %s: starting Spark", stream_name)
    spark: SparkSession | None = None
    error: str | None = None
    try:
        spark = loopback_session(
            f"partq-spark-job-{stream_name}",
            master=master or (None if under_spark_submit else "local[2]"),
            conf=conf,
        )
        stop.install()  # again: SparkContext replaced SIGINT's with one raising KeyboardInterrupt
        if not stop.event.is_set():
            spark.sparkContext.setLogLevel("WARN")
            query_name = f"partq-{stream_name}"
            spark.streams.addListener(ProgressListener(query_name, stream_name))
            frame = _source(
                spark,
                source=source,
                fmt=fmt,
                schema=schema,
                rate=rate,
                max_files=max_files_per_trigger,
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
            what = f"{rate} rows/s" if rate else f"{fmt} files from {source}"
            error = _run_query(writer, spec, stop, f"{what} (checkpoint {checkpoint})")
    except Exception as e:
        if not stop.event.is_set():
            raise
        error = _brief(e)
    finally:
        if spark is not None:
            _stop_session(spark, stop)
    if error is not None and stop.event.is_set():
        # Stopping anyway: the usual cause is a JVM that got the signal too (a terminal's
        # Ctrl-C, or a supervisor signalling the whole group) and was already shutting down.
        # What was not committed is published again from the checkpoint by the next run.
        log.warning(
            "stream %s: stopped on %s; Spark ended first (%s)",
            stream_name,
            stop.received,
            failure_reason(error),
        )
        return
    if error is not None:
        raise PartqError(f"the Spark query failed: {failure_reason(error)}")
    log.info("stream %s: stopped%s", stream_name, _after(stop))


def _run_query(
    writer: DataStreamWriter, spec: StreamSpec, stop: StopSignal, what: str
) -> str | None:
    """Start the query and wait until it ends or ``stop`` is set; the query's error."""
    query = writer.start()
    log.info(
        "stream %s: query %s publishing %s to %d partitions",
        spec.name,
        query.id,
        what,
        spec.partitions,
    )
    while not stop.event.wait(0.5) and query.isActive:
        pass
    if stop.received is not None:
        log.info("stream %s: %s received, stopping the query", spec.name, stop.received)
        query.stop()
    error = query.exception()
    return None if error is None else str(error)


def _stop_session(spark: SparkSession, stop: StopSignal) -> None:
    try:
        spark.stop()
    except Exception:
        if not stop.event.is_set():
            raise  # else: the JVM is gone already (run_job says so)


def _after(stop: StopSignal) -> str:
    return "" if stop.received is None else f" on {stop.received}"


def _brief(error: BaseException) -> str:
    """The first line of an error's text (a Py4J error's holds a Java stack trace)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else "no message"

"""The ``partq`` streaming sink on Spark's Python Data Source API.

::

    partq.producer.spark.register(spark)
    (partq.producer.spark.prepare(df, spec, "user_id")
        .writeStream.format("partq")
        .option("stream", "orders").option("keyColumn", "user_id")
        .option("checkpointLocation", "/chk/orders")
        .start())

Lifecycle (Spark 4): for every micro-batch Spark calls ``streamWriter()`` in a
driver-side Python worker — here the options, the spec and the schema are
checked, so a wrong ``partitions`` or a missing ``prepare()`` fails the query
before any task runs — pickles the writer to the executors, runs ``write()``
once per task, and, when every task succeeded, calls ``commit()`` (on a writer
built the same way); then the batch is recorded in the checkpoint. ``write()``
returns only after every confirm (:func:`~partq.producer.spark.publish.publish_task`),
so a committed batch is a confirmed batch.

Where the ids come from. The Data Source API hands ``write()`` neither the
query id nor the batch id. Spark sets both as local properties of every task of
a micro-batch (``sql.streaming.queryId``: the query's id, which Spark keeps in
``<checkpoint>/metadata`` and so is the same after a restart;
``streaming.sql.batchId``), and the sink reads them from ``TaskContext``. The
option ``queryId`` overrides the query id, e.g. to keep ids stable when a
checkpoint is recreated.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from partq.producer.contract import StreamSpec
from partq.producer.spark.options import SinkOptions
from partq.producer.spark.publish import (
    TaskReport,
    check_one_task_per_partition,
    publish_task,
    rerouted_note,
)
from partq.producer.spark.rows import RowLayout
from pyspark import TaskContext
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from partq.kernel.errors import UsageError

__all__ = [
    "BATCH_ID_PROPERTY",
    "QUERY_ID_PROPERTY",
    "PartqDataSource",
    "PartqStreamWriter",
    "register",
    "task_identity",
]

log = logging.getLogger("partq.spark")

QUERY_ID_PROPERTY = "sql.streaming.queryId"  # StreamExecution.QUERY_ID_KEY
BATCH_ID_PROPERTY = "streaming.sql.batchId"  # MicroBatchExecution.BATCH_ID_KEY


def task_identity(context: TaskContext, query_id: str | None) -> tuple[str, int]:
    """(query id, batch id) of the micro-batch this task belongs to."""
    query_id = query_id or context.getLocalProperty(QUERY_ID_PROPERTY)
    batch = context.getLocalProperty(BATCH_ID_PROPERTY)
    if not query_id or batch is None:
        raise UsageError(
            "this task carries no streaming query or batch id: the partq sink only runs in a "
            "micro-batch streaming query (use trigger(processingTime=…) or availableNow)"
        )
    return query_id, int(batch)


class PartqStreamWriter(DataSourceStreamWriter):
    """Publishes each task's rows and commits a batch only when all were confirmed."""

    def __init__(self, options: SinkOptions, spec: StreamSpec, layout: RowLayout) -> None:
        self.options = options
        self.spec = spec
        self.layout = layout

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        context = TaskContext.get()
        if context is None:
            raise UsageError("PartqStreamWriter.write runs only inside a Spark task")
        query_id, batch_id = task_identity(context, self.options.query_id)
        return publish_task(
            iterator,
            layout=self.layout,
            spec=self.spec,
            options=self.options,
            query_id=query_id,
            batch_id=batch_id,
            task=context.partitionId(),
        )

    def commit(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:
        reports = [m if isinstance(m, TaskReport) else None for m in messages]
        rows = check_one_task_per_partition(reports, batchId)
        log.info(
            "stream %s batch %d: %d rows confirmed%s",
            self.spec.name,
            batchId,
            rows,
            rerouted_note(reports),
        )

    def abort(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:
        log.warning(
            "stream %s batch %d aborted: it is not committed and will be published again "
            "(same message ids) when the query runs it again",
            self.spec.name,
            batchId,
        )


class PartqDataSource(DataSource):
    """Spark format ``partq``: a streaming sink into a partq stream."""

    @classmethod
    def name(cls) -> str:
        return "partq"

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        if overwrite:
            raise UsageError(
                "the partq sink appends messages; it cannot overwrite: use outputMode('append') "
                "or 'update', not 'complete'"
            )
        options = SinkOptions.from_options(self.options)
        spec = options.current_spec()
        layout = RowLayout.from_schema(schema, options, spec)
        return PartqStreamWriter(options, spec, layout)


def register(spark: SparkSession) -> None:
    """Make ``writeStream.format("partq")`` available on ``spark``."""
    spark.dataSource.register(PartqDataSource)

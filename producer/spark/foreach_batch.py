"""``foreach_batch_writer``: the same publishing, for ``writeStream.foreachBatch``.

Inside ``foreachBatch`` each micro-batch is a static DataFrame, so Spark can
sort it (and spill to disk) — this path does not hold a task's rows in memory
as the ``partq`` format does. The writer reads the stream's spec when it is made
(in the driver) and pins it; each call takes the newest layout
(:meth:`~partq.producer.spark.options.SinkOptions.current_spec`: the pinned one while
etcd is away), prepares the batch for it, publishes every Spark partition in
one task, and returns only when all tasks got every confirm; an exception fails
the batch and Spark does not commit it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from partq.producer.contract import StreamSpec
from partq.producer.spark.options import DEFAULT_SPEC_READER, SinkOptions
from partq.producer.spark.partitioning import prepare
from partq.producer.spark.publish import (
    TaskReport,
    check_one_task_per_partition,
    publish_task,
    rerouted_note,
)
from partq.producer.spark.rows import RowLayout
from partq.producer.spark.sink import QUERY_ID_PROPERTY
from pyspark.sql import DataFrame

from partq.kernel.amqp import DEFAULT_AMQP_URL, AmqpURL
from partq.kernel.errors import UsageError

__all__ = ["BatchWriter", "foreach_batch_writer"]

log = logging.getLogger("partq.spark")


def _publish_partition(
    index: int,
    rows: Iterable[Any],
    *,
    layout: RowLayout,
    spec: StreamSpec,
    options: SinkOptions,
    query_id: str,
    batch_id: int,
) -> Iterator[TaskReport]:
    yield publish_task(
        rows,
        layout=layout,
        spec=spec,
        options=options,
        query_id=query_id,
        batch_id=batch_id,
        task=index,
        presorted=True,
    )


@dataclass(frozen=True)
class BatchWriter:
    """``query.foreachBatch(writer)``: publish each micro-batch to the stream."""

    options: SinkOptions  # pinned
    num_tasks: int | None = None

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        spec = self.options.current_spec()
        started = time.monotonic()
        query_id = self.options.query_id or df.sparkSession.sparkContext.getLocalProperty(
            QUERY_ID_PROPERTY
        )
        if not query_id:
            raise UsageError(
                "no streaming query id: call this writer from writeStream.foreachBatch, "
                "or give it query_id="
            )
        prepared = prepare(
            df,
            spec,
            self.options.key_column,
            self.options.order_column,
            num_tasks=self.num_tasks,
        )
        layout = RowLayout.from_schema(prepared.schema, self.options, spec)
        publish = functools.partial(
            _publish_partition,
            layout=layout,
            spec=spec,
            options=self.options,
            query_id=query_id,
            batch_id=batch_id,
        )
        reports = prepared.rdd.mapPartitionsWithIndex(publish).collect()
        rows = check_one_task_per_partition(reports, batch_id)
        log.info(
            "stream %s batch %d: %d rows confirmed in %.2fs by %d tasks%s",
            spec.name,
            batch_id,
            rows,
            time.monotonic() - started,
            len(reports),
            rerouted_note(reports),
        )


def foreach_batch_writer(
    stream: str,
    *,
    key_column: str,
    value_column: str | None = None,
    headers_column: str | None = None,
    order_column: str | None = None,
    etcd_endpoints: str = "",
    amqp_url: AmqpURL = DEFAULT_AMQP_URL,
    partitions: int | None = None,
    window: int = 1000,
    spec_reader: str = DEFAULT_SPEC_READER,
    query_id: str | None = None,
    confirm_timeout: float = 120.0,
    num_tasks: int | None = None,
) -> BatchWriter:
    """A ``foreachBatch`` function publishing to ``stream``; reads and pins the spec now.

    The arguments mean what the ``partq`` format's options of the same names do.
    """
    options = SinkOptions(
        stream=stream,
        key_column=key_column,
        value_column=value_column,
        headers_column=headers_column,
        order_column=order_column,
        etcd_endpoints=etcd_endpoints,
        amqp_url=amqp_url,
        partitions=partitions,
        window=window,
        spec_reader=spec_reader,
        query_id=query_id,
        confirm_timeout=confirm_timeout,
    )
    return BatchWriter(options.pinned(), num_tasks)

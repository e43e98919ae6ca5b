"""Spark Structured Streaming into a partq stream: the ``partq`` sink and its helpers.

Two ways to publish, with the same contract:

* the ``partq`` format (Python Data Source API)::

      partq.producer.spark.register(spark)
      prepared = partq.producer.spark.prepare(df, spec, "user_id", order_column="ts")
      (prepared.writeStream.format("partq")
          .options(**partq.producer.spark.SinkOptions("orders", "user_id").pinned().to_options())
          .option("checkpointLocation", "/chk/orders").start())

* ``df.writeStream.foreachBatch(partq.producer.spark.foreach_batch_writer("orders",
key_column=…))``.

The contract (same as the producer SDK's): a row's partition is
``partq.producer.contract.partition_for(key, P)``; the spec is read from etcd before
anything is published and a configured ``partitions`` that disagrees fails the
query; every partition of a micro-batch is published by one task, in order
(order column, then source order); confirms are pipelined and a batch is
committed only after every message was confirmed. Delivery is at-least-once:
a retried task or a restarted query publishes again, with the same
deterministic ``message_id`` (``query:batch:partition:seq``, see
:mod:`partq.producer.spark.replay`) and body — effectively-once for a consumer that
drops ids it has seen, provided the source replays batches deterministically.

Needs the ``spark`` extra (pyspark, pyarrow); ``producer`` itself never imports
this package. The names below load their module on first use, so the pure parts
(:mod:`~partq.producer.spark.replay`, :mod:`~partq.producer.spark.options`,
:mod:`~partq.producer.spark.metrics`) import without pyspark, e.g. in a consumer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from partq.producer.spark.foreach_batch import BatchWriter, foreach_batch_writer
    from partq.producer.spark.options import DEFAULT_SPEC_READER, SinkOptions
    from partq.producer.spark.partitioning import prepare
    from partq.producer.spark.progress import ProgressListener, failure_reason
    from partq.producer.spark.replay import HEADER_BATCH_ID, HEADER_QUERY_ID, HEADER_SEQ, ReplayId
    from partq.producer.spark.rows import ORDER_COLUMN, PARTITION_COLUMN, POSITION_COLUMN
    from partq.producer.spark.session import loopback_session
    from partq.producer.spark.sink import PartqDataSource, register

_HOME = {
    "BatchWriter": "foreach_batch",
    "foreach_batch_writer": "foreach_batch",
    "DEFAULT_SPEC_READER": "options",
    "SinkOptions": "options",
    "prepare": "partitioning",
    "ProgressListener": "progress",
    "failure_reason": "progress",
    "HEADER_BATCH_ID": "replay",
    "HEADER_QUERY_ID": "replay",
    "HEADER_SEQ": "replay",
    "ReplayId": "replay",
    "ORDER_COLUMN": "rows",
    "PARTITION_COLUMN": "rows",
    "POSITION_COLUMN": "rows",
    "loopback_session": "session",
    "PartqDataSource": "sink",
    "register": "sink",
}

__all__ = [
    "DEFAULT_SPEC_READER",
    "HEADER_BATCH_ID",
    "HEADER_QUERY_ID",
    "HEADER_SEQ",
    "ORDER_COLUMN",
    "PARTITION_COLUMN",
    "POSITION_COLUMN",
    "BatchWriter",
    "PartqDataSource",
    "ProgressListener",
    "ReplayId",
    "SinkOptions",
    "failure_reason",
    "foreach_batch_writer",
    "loopback_session",
    "prepare",
    "register",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'partq.producer.spark' has no attribute {name!r}")
    return getattr(importlib.import_module(f"partq.producer.spark.{_HOME[name]}"), name)

"""The Spark job's Prometheus metrics: every name the Spark side exports is here.

They live in the driver's process and are fed by
:class:`partq.producer.spark.progress.ProgressListener` from Spark's query progress
(executors publish from other processes, so they cannot count for it).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

__all__ = ["BATCH_FAILURES", "BATCH_SECONDS", "ROWS_PUBLISHED"]

ROWS_PUBLISHED = Counter(
    "partq_spark_rows_published",
    "Rows of committed micro-batches: each was published and confirmed",
    ["stream"],
)
BATCH_SECONDS = Histogram(
    "partq_spark_batch_duration_seconds",
    "Wall time of a committed micro-batch, from planning to commit",
    ["stream"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
BATCH_FAILURES = Counter(
    "partq_spark_batch_failures",
    "Micro-batches that failed and stopped the query (nothing of them was committed)",
    ["stream"],
)

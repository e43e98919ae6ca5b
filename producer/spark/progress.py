"""Per-batch progress of a partq query: a log line and the metrics, from Spark's events."""

from __future__ import annotations

import logging
import re

from partq.producer.spark import metrics
from pyspark.sql.streaming.listener import (
    QueryIdleEvent,
    QueryProgressEvent,
    QueryStartedEvent,
    QueryTerminatedEvent,
    StreamingQueryListener,
)

__all__ = ["ProgressListener", "failure_reason"]

log = logging.getLogger("partq.spark")

# How a partq error appears in the Python traceback Spark wraps into its own exception.
_PARTQ_ERROR = re.compile(r"^(?:partq\.kernel\.errors\.)?([A-Z]\w+): (.+)$", re.MULTILINE)
_OURS = {
    "BrokerUnavailable",
    "ConnectionLost",
    "InvalidStreamName",
    "MessageNacked",
    "MessageUnroutable",
    "PublishFailed",
    "SpecMismatch",
    "StreamNotFound",
    "UsageError",
    "EtcdUnavailable",
}


def failure_reason(text: str) -> str:
    """The partq error inside a Spark failure's text, else its first line."""
    found = [m for m in _PARTQ_ERROR.finditer(text) if m.group(1) in _OURS]
    if found:
        name, message = found[-1].groups()
        return f"{name}: {message}"
    return text.strip().splitlines()[0] if text.strip() else "unknown failure"


class ProgressListener(StreamingQueryListener):
    """Logs each batch of the query named ``query_name`` and feeds the partq Spark metrics."""

    def __init__(self, query_name: str, stream: str) -> None:
        self.query_name = query_name
        self.stream = stream
        self._ids: set[str] = set()

    def onQueryStarted(self, event: QueryStartedEvent) -> None:
        if event.name == self.query_name:
            self._ids.add(str(event.id))
            log.info("stream %s: query %s started (run %s)", self.stream, event.id, event.runId)

    def onQueryProgress(self, event: QueryProgressEvent) -> None:
        progress = event.progress
        if progress.name != self.query_name:
            return
        # What the sink wrote (a query may filter or explode rows); -1 if it cannot tell.
        written = progress.sink.numOutputRows
        rows = written if written >= 0 else progress.numInputRows
        seconds = progress.batchDuration / 1000
        metrics.ROWS_PUBLISHED.labels(self.stream).inc(rows)
        metrics.BATCH_SECONDS.labels(self.stream).observe(seconds)
        rate = rows / seconds if seconds > 0 else 0.0
        log.info(
            "stream %s batch %d: %d rows published in %.2fs (%.0f rows/s)",
            self.stream,
            progress.batchId,
            rows,
            seconds,
            rate,
        )

    def onQueryIdle(self, event: QueryIdleEvent) -> None:
        pass

    def onQueryTerminated(self, event: QueryTerminatedEvent) -> None:
        if str(event.id) not in self._ids:
            return
        if event.exception:
            metrics.BATCH_FAILURES.labels(self.stream).inc()
            log.error("stream %s: query failed: %s", self.stream, failure_reason(event.exception))
        else:
            log.info("stream %s: query stopped", self.stream)

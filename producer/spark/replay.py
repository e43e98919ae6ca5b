"""Deterministic message ids for Spark publishes, so replays can be recognised.

A Spark sink is at-least-once: a failed task or a query restarted from its
checkpoint publishes a micro-batch again. Every message the sink publishes
therefore carries an id that depends only on *what* it is, never on *when* it
was sent::

    message_id = f"{query_id}:{batch_id}:{partition}:{seq}"

``query_id`` is the streaming query's id (stable across restarts from one
checkpoint), ``batch_id`` the micro-batch, ``partition`` the partq partition
and ``seq`` the message's position among that partition's rows in the batch
(0, 1, 2 …). The parts also travel as headers (:data:`HEADER_QUERY_ID` …), so
a handler can deduplicate without parsing the id. When the source replays a
batch with the same rows (file sources, Kafka, the rate source do), a replayed
message has the same id *and* the same body: effectively-once for a consumer
that drops ids it has seen.

Pure: no I/O, no Spark.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "HEADER_BATCH_ID",
    "HEADER_QUERY_ID",
    "HEADER_SEQ",
    "ReplayId",
    "message_id",
    "replay_headers",
]

HEADER_QUERY_ID = "partq-query-id"
HEADER_BATCH_ID = "partq-batch-id"
HEADER_SEQ = "partq-seq"


def message_id(query_id: str, batch_id: int, partition: int, seq: int) -> str:
    """The message id of one Spark-published message (the only place that formats it)."""
    return f"{query_id}:{batch_id}:{partition}:{seq}"


def replay_headers(query_id: str, batch_id: int, seq: int) -> dict[str, str | int]:
    """The id's parts as headers (the partition travels in ``partq-partition`` already)."""
    return {HEADER_QUERY_ID: query_id, HEADER_BATCH_ID: batch_id, HEADER_SEQ: seq}


@dataclass(frozen=True, slots=True)
class ReplayId:
    """Where a Spark-published message comes from: query, batch, partition, sequence."""

    query_id: str
    batch_id: int
    partition: int
    seq: int

    def __post_init__(self) -> None:
        if not self.query_id or ":" in self.query_id:
            raise ValueError(f"query id must be non-empty and without ':', got {self.query_id!r}")
        if min(self.batch_id, self.partition, self.seq) < 0:
            raise ValueError(f"batch, partition and seq must be >= 0: {self}")

    @property
    def message_id(self) -> str:
        return message_id(self.query_id, self.batch_id, self.partition, self.seq)

    def headers(self) -> dict[str, str | int]:
        return replay_headers(self.query_id, self.batch_id, self.seq)

    @classmethod
    def parse(cls, message_id: str) -> ReplayId:
        """The parts of a message id made by :attr:`message_id`; ``ValueError`` otherwise."""
        parts = message_id.split(":")
        if len(parts) != 4:
            raise ValueError(f"{message_id!r} is not a partq Spark message id")
        query_id, batch_id, partition, seq = parts
        return cls(query_id, int(batch_id), int(partition), int(seq))

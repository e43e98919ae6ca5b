"""What a handler receives, and how a handler is named on the command line."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from producer.contract import HEADER_PUBLISHED_MS, decode_key
from producer.errors import UsageError
from producer.spark.replay import HEADER_BATCH_ID, HEADER_QUERY_ID, HEADER_SEQ, ReplayId

__all__ = ["Handler", "Message", "load_handler"]


@dataclass(frozen=True, slots=True)
class Message:
    """One delivery. The handler acks it by returning; raising retries it (up to a bound).

    ``attempt`` counts deliveries of this message to a handler, starting at 1
    (quorum queues' ``x-delivery-count`` is included). Spark-published messages
    carry ``partq-query-id``/``partq-batch-id``/``partq-seq`` headers and a
    deterministic ``message_id``: deduplicate replays on it.
    """

    stream: str
    partition: int
    key: str | bytes | None
    body: bytes
    message_id: str | None
    headers: Mapping[str, Any] = field(default_factory=dict)
    redelivered: bool = False
    attempt: int = 1
    published_ms: int | None = None

    @property
    def replay(self) -> ReplayId | None:
        """For a Spark-published message, its (query, batch, partition, seq); else None.

        A replayed micro-batch repeats the same ids: drop ``message_id``s you have
        handled to get effectively-once.
        """
        h = self.headers
        if HEADER_QUERY_ID not in h or HEADER_BATCH_ID not in h or HEADER_SEQ not in h:
            return None
        query = h[HEADER_QUERY_ID]
        query_id = query.decode() if isinstance(query, bytes) else str(query)
        return ReplayId(query_id, int(h[HEADER_BATCH_ID]), self.partition, int(h[HEADER_SEQ]))


Handler = Callable[[Message], object]


def message_from(
    stream: str,
    partition: int,
    body: bytes,
    message_id: str | None,
    headers: Mapping[str, Any] | None,
    redelivered: bool,
    attempt: int,
) -> Message:
    headers = dict(headers or {})
    delivered_before = int(headers.get("x-delivery-count", 0) or 0)
    published = headers.get(HEADER_PUBLISHED_MS)
    return Message(
        stream=stream,
        partition=partition,
        key=decode_key(headers),
        body=body,
        message_id=message_id,
        headers=headers,
        redelivered=redelivered,
        attempt=delivered_before + attempt,
        published_ms=int(published) if published is not None else None,
    )


def load_handler(spec: str) -> Handler:
    """``"pkg.module:function"`` → the function."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"handler {spec!r} must look like pkg.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"cannot import handler module {module_name!r}: {e}") from None
    handler = getattr(module, attr, None)
    if not callable(handler):
        raise UsageError(f"{module_name!r} has no callable {attr!r}")
    return handler  # type: ignore[no-any-return]

"""Example handlers for the demo, docs and deploy manifests."""

from __future__ import annotations

import json
import os
import time

from partq.consumers.handling.message import Message


def print_handler(message: Message) -> None:
    """Print each message; returning acks it."""
    key = message.key.decode(errors="replace") if isinstance(message.key, bytes) else message.key
    print(f"p{message.partition} key={key} id={message.message_id} {message.body[:80]!r}")


def noop_handler(message: Message) -> None:
    """Ack without doing anything (for throughput measurements)."""


def _seq(body: bytes) -> int | None:
    """The sequence number in a body: ``{"seq": n, ...}`` or a bare ``n``."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if isinstance(value, dict):
        value = value.get("seq")
    return value if isinstance(value, int) else None


def record_handler(message: Message) -> None:
    """Append one JSON line per handling to ``$PARTQ_RECORD`` (for ``partq demo`` and tests).

    ``$PARTQ_RECORD_SLEEP`` (seconds, default 0.002) stands for the handler's work; the
    line carries member, partition, key, seq, message id, redelivered, attempt, pid, start,
    end and the publisher's time (``published_ms``), as :mod:`examples.audit` reads them.
    One ``os.write`` per line with ``O_APPEND``, so processes writing one file do not
    interleave lines.
    """
    start = time.time()
    time.sleep(float(os.environ.get("PARTQ_RECORD_SLEEP", "0.002")))
    write_record(message, start, time.time())


def write_record(message: Message, start: float, end: float) -> None:
    """:func:`record_handler`'s line for ``message``, handled from ``start`` to ``end``."""
    key = message.key.decode() if isinstance(message.key, bytes) else message.key
    line = json.dumps(
        {
            "member": os.environ.get("PARTQ_MEMBER_ID", ""),
            "partition": message.partition,
            "key": key,
            "seq": _seq(message.body),
            "message_id": message.message_id,
            "redelivered": message.redelivered,
            "attempt": message.attempt,
            "pid": os.getpid(),
            "published_ms": message.published_ms,
            "fencing_token": message.fencing_token,
            "start": start,
            "end": end,
        },
        sort_keys=True,
    )
    fd = os.open(os.environ["PARTQ_RECORD"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)

"""Example handlers for the demo, docs and deploy manifests."""

from __future__ import annotations

from consumers.message import Message


def print_handler(message: Message) -> None:
    """Print each message; returning acks it."""
    key = message.key.decode(errors="replace") if isinstance(message.key, bytes) else message.key
    print(f"p{message.partition} key={key} id={message.message_id} {message.body[:80]!r}")


def noop_handler(message: Message) -> None:
    """Ack without doing anything (for throughput measurements)."""


def record_handler(message: Message) -> None:
    """Append one JSON line per message to ``$PARTQ_RECORD`` (used by ``partq demo``)."""
    import json
    import os
    import time

    started = time.time()
    time.sleep(float(os.environ.get("PARTQ_RECORD_SLEEP", "0.001")))
    line = json.dumps({
        "member": os.environ.get("PARTQ_MEMBER_ID", ""), "partition": message.partition,
        "key": message.key if isinstance(message.key, str) else repr(message.key),
        "body": message.body.decode(errors="replace"), "id": message.message_id,
        "redelivered": message.redelivered, "start": started, "end": time.time(),
    })  # fmt: skip
    fd = os.open(os.environ["PARTQ_RECORD"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)

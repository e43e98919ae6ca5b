"""Handlers for consumer subprocesses in the invariant tests: each handled message is one JSON line.

Environment (read per call, so the module has no import-time I/O):
``PARTQ_TEST_RECORD`` (the file), ``PARTQ_TEST_MEMBER``, ``PARTQ_TEST_HANDLER_SLEEP``
(seconds between start and end, default 0.002). Lines are written with one
``os.write`` on an ``O_APPEND`` descriptor, so concurrent processes never interleave.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from consumers.message import Message

__all__ = ["poison", "record"]


def _seq(body: bytes) -> int | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value.get("seq") if isinstance(value, dict) else None


def _write(line: dict[str, Any]) -> None:
    path = os.environ["PARTQ_TEST_RECORD"]
    data = (json.dumps(line, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def record(message: Message) -> None:
    start = time.time()
    time.sleep(float(os.environ.get("PARTQ_TEST_HANDLER_SLEEP", "0.002")))
    end = time.time()
    key = message.key.decode() if isinstance(message.key, bytes) else message.key
    _write({
        "member": os.environ.get("PARTQ_TEST_MEMBER", ""),
        "partition": message.partition,
        "key": key,
        "seq": _seq(message.body),
        "message_id": message.message_id,
        "redelivered": message.redelivered,
        "attempt": message.attempt,
        "pid": os.getpid(),
        "start": start,
        "end": end,
    })  # fmt: skip


def poison(message: Message) -> None:
    if b"poison" in message.body:
        raise ValueError(f"poison message {message.message_id}")
    record(message)

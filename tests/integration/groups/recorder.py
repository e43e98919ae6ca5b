"""Handlers for the invariant tests' consumer processes.

``record`` is :func:`examples.handlers.record_handler` (one JSON line per handling
to ``$PARTQ_RECORD``), ``record_async`` the same as an ``async def`` (it awaits
``$PARTQ_RECORD_SLEEP`` seconds); ``poison`` raises for bodies containing ``poison``;
``poison_key`` raises for ``$PARTQ_POISON_KEY``'s messages from seq
``$PARTQ_POISON_SEQ`` on while the file ``$PARTQ_POISON_FLAG`` exists (delete it to
"fix the handler"), and takes ``$PARTQ_POISON_SLOW`` seconds per message of that key;
``slow_while`` takes ``$PARTQ_SLOW_SLEEP`` seconds per message while the file
``$PARTQ_SLOW_FLAG`` exists (a backlog made on purpose), then records; ``record_stepwise``
works ``$PARTQ_RECORD_SLEEP`` seconds in 5 ms steps, then records (a process frozen inside
it still has its remaining steps to do on resuming, as real work would, where one sleep
would end at once); ``record_rate`` records ``partq spark-job --rate``'s rows with their
``value`` as the seq.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time

from partq.consumers.handling.message import Message

from examples.handlers import record_handler as record
from examples.handlers import write_record

__all__ = [
    "poison",
    "poison_key",
    "record",
    "record_async",
    "record_rate",
    "record_stepwise",
    "slow_while",
]

STEP = 0.005  # record_stepwise's step


async def record_async(message: Message) -> None:
    start = time.time()
    await asyncio.sleep(float(os.environ.get("PARTQ_RECORD_SLEEP", "0.002")))
    write_record(message, start, time.time())


def record_stepwise(message: Message) -> None:
    start = time.time()
    for _ in range(max(1, round(float(os.environ.get("PARTQ_RECORD_SLEEP", "0.002")) / STEP))):
        time.sleep(STEP)
    write_record(message, start, time.time())


def poison(message: Message) -> None:
    if b"poison" in message.body:
        raise ValueError(f"poison message {message.message_id}")
    record(message)


def poison_key(message: Message) -> None:
    key = message.key.decode() if isinstance(message.key, bytes) else message.key
    chosen = os.environ.get("PARTQ_POISON_KEY", "").split(",")  # one key, or several
    poisoned = key in chosen and os.path.exists(os.environ["PARTQ_POISON_FLAG"])
    if poisoned and json.loads(message.body)["seq"] >= int(os.environ["PARTQ_POISON_SEQ"]):
        raise ValueError(f"poisoned message {message.message_id}")
    if key in chosen:  # once fixed, slower: a replay takes time
        time.sleep(float(os.environ.get("PARTQ_POISON_SLOW", "0")))
    record(message)


def slow_while(message: Message) -> None:
    start = time.time()
    if os.path.exists(os.environ["PARTQ_SLOW_FLAG"]):
        time.sleep(float(os.environ.get("PARTQ_SLOW_SLEEP", "0.05")))
    write_record(message, start, time.time())


def record_rate(message: Message) -> None:
    """``record`` for the rows of ``partq spark-job --rate``: the body is the row's other
    columns as JSON (``{"timestamp": ..., "value": n}``, key ``key-<n % 1000>``), and ``n``
    is the seq. The source's values ascend and are published in order per key, so they
    are a per-key sequence as the audit reads one; only gaps between a key's values are
    wider (1,000) than a SequenceProducer's."""
    value = json.loads(message.body)["value"]
    record(dataclasses.replace(message, body=json.dumps({"seq": value}).encode()))

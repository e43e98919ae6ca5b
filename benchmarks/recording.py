"""The consumer-group benchmarks' handler: the product's recorder, failing on demand.

:func:`record` is :func:`examples.handlers.record_handler` (one JSON line per handling
to ``$PARTQ_RECORD``, as :mod:`examples.audit` reads them). With
``PARTQ_BENCH_FAIL_EVERY=N`` the first attempt of every message whose seq is a multiple
of N raises instead, unrecorded (to measure handler retries). :func:`record_async` is the
same recorder as an ``async def`` that awaits ``asyncio.sleep($PARTQ_RECORD_SLEEP)``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from partq.consumers.handling.message import Message

from examples.handlers import record_handler, write_record

FAIL_EVERY = int(os.environ.get("PARTQ_BENCH_FAIL_EVERY", "0") or 0)


def record(message: Message) -> None:
    if FAIL_EVERY and message.attempt == 1:
        seq = json.loads(message.body)["seq"]
        if seq % FAIL_EVERY == 0:
            raise RuntimeError(f"benchmark: induced failure of {message.key!r} seq {seq}")
    record_handler(message)


async def record_async(message: Message) -> None:
    start = time.time()
    await asyncio.sleep(float(os.environ.get("PARTQ_RECORD_SLEEP", "0")))
    write_record(message, start, time.time())

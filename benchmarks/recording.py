"""The consumer-group benchmarks' handler: the product's recorder, failing on demand.

:func:`record` is :func:`examples.handlers.record_handler` (one JSON line per handling
to ``$PARTQ_RECORD``, as :mod:`examples.audit` reads them). With
``PARTQ_BENCH_FAIL_EVERY=N`` the first attempt of every message whose seq is a multiple
of N raises instead, unrecorded (to measure handler retries).
"""

from __future__ import annotations

import json
import os

from partq.consumers.handling.message import Message

from examples.handlers import record_handler

FAIL_EVERY = int(os.environ.get("PARTQ_BENCH_FAIL_EVERY", "0") or 0)


def record(message: Message) -> None:
    if FAIL_EVERY and message.attempt == 1:
        seq = json.loads(message.body)["seq"]
        if seq % FAIL_EVERY == 0:
            raise RuntimeError(f"benchmark: induced failure of {message.key!r} seq {seq}")
    record_handler(message)

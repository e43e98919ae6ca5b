"""A recording handler for the consumer-group benchmarks.

Each handling appends one line to ``$PARTQ_BENCH_RECORD``:
``member partition key seq start end attempt redelivered status`` (wall-clock
seconds, so lines from several processes can be merged). With
``PARTQ_BENCH_FAIL_EVERY=N`` the first attempt of every message whose seq is a
multiple of N raises (to measure handler retries).
"""

from __future__ import annotations

import os
import threading
import time

from consumers.message import Message

_lock = threading.Lock()
_fd: int | None = None
MEMBER = os.environ.get("PARTQ_MEMBER_ID", f"pid{os.getpid()}")
FAIL_EVERY = int(os.environ.get("PARTQ_BENCH_FAIL_EVERY", "0") or 0)


def _out() -> int:
    global _fd
    if _fd is None:
        with _lock:
            if _fd is None:
                _fd = os.open(
                    os.environ["PARTQ_BENCH_RECORD"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
                )
    return _fd


def record(message: Message) -> None:
    start = time.time()
    key, seq, _ = message.body.split(b":", 2)
    fail = bool(FAIL_EVERY) and int(seq) % FAIL_EVERY == 0 and message.attempt == 1
    end = time.time()
    line = (
        f"{MEMBER} {message.partition} {key.decode()} {int(seq)} {start:.6f} {end:.6f} "
        f"{message.attempt} {int(message.redelivered)} {'fail' if fail else 'ok'}\n"
    )
    os.write(_out(), line.encode())  # O_APPEND: one write per line survives kill -9
    if fail:
        raise RuntimeError(f"benchmark: induced failure of {key.decode()}:{int(seq)}")

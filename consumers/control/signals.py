"""SIGTERM/SIGINT: the first asks for a graceful stop, a second exits at once.

Threads: Python runs a signal handler on the main thread, between two bytecodes of
whatever that thread was doing. The main thread is also the one that waits on the stop it
would set (the consumer's event queue, the coordinator's ``threading.Event``), and their
locks are not re-entrant: a handler calling ``stop()`` while the main thread held such a
lock would wait for itself forever. So the handler only puts the signal on a
``queue.SimpleQueue`` (whose ``put`` is safe to call from a signal handler), and a thread
started here calls ``stop()``.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

__all__ = ["on_stop_signals"]


def on_stop_signals(stop: Callable[[], None]) -> None:
    received: queue.SimpleQueue[int] = queue.SimpleQueue()
    count = 0

    def handle(signum: int, frame: FrameType | None) -> None:
        nonlocal count
        count += 1
        if count > 1:
            sys.stderr.write("partq: second signal: exiting now\n")
            os._exit(1)
        received.put(signum)

    def relay() -> None:
        received.get()
        stop()

    threading.Thread(target=relay, name="partq-stop-signal", daemon=True).start()
    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)

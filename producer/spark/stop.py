"""The Spark job's stop request: SIGTERM/SIGINT set an event that its main loop waits on.

Imports no pyspark, so ``partq spark-job`` installs it before anything slow starts.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["StopSignal"]


class StopSignal:
    """SIGTERM/SIGINT set an event; the main loop stops the query (py4j is not reentrant).

    The entry point installs it before anything slow: Spark takes seconds to start (over
    40 s on a busy machine), and a signal then must stop the job, not kill it halfway.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self.received: str | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        self.event.set()

    def install(self) -> StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self)
        return self

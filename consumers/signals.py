"""SIGTERM/SIGINT: the first asks for a graceful stop, a second exits at once."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

__all__ = ["on_stop_signals"]


def on_stop_signals(stop: Callable[[], None]) -> None:
    count = 0

    def handle(signum: int, frame: FrameType | None) -> None:
        nonlocal count
        count += 1
        if count > 1:
            sys.stderr.write("partq: second signal: exiting now\n")
            os._exit(1)
        stop()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)

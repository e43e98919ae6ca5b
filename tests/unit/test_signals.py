"""partq.consumers.control.signals: a stop signal never runs ``stop()`` inside the signal
handler."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
from partq.consumers.control.signals import on_stop_signals

from tests.polling import wait_until


@pytest.fixture
def restored_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)


def test_sigterm_stops_from_another_thread_even_while_the_main_thread_holds_its_lock(
    restored_handlers: None,
) -> None:
    # Given a stop that takes a lock the main thread holds when the signal arrives
    lock = threading.Lock()
    stopped_on: list[str] = []

    def stop() -> None:
        with lock:
            stopped_on.append(threading.current_thread().name)

    on_stop_signals(stop)
    # When SIGTERM is handled while the main thread holds that lock
    with lock:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # bytecodes pass: the handler runs on this thread meanwhile
            pass
        # Then the handler did not call stop() here (it would have waited for this lock)
        assert stopped_on == []
    # And stop() ran once, on the relay thread, once the lock was free
    wait_until(lambda: stopped_on == ["partq-stop-signal"], 5, 0.01, "stop() called")

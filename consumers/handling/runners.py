"""Where handler calls run: a member-wide pool of threads, and one asyncio event loop.

Both are owned by the daemon (one each per member, made by ``partq.consumers.control.partitions``)
and
shared by its partitions' workers:

- :class:`HandlerPool`: ``--concurrency`` N daemon threads that run the per-message work
  of keyed workers (``partq.consumers.handling.keyed``); at most N messages of the member are in a
  handler at once, first come, first served, except that a partition's first message
  after it was acquired goes ahead of what is queued (``submit(first=True)``): a handoff
  need not wait for the member's other partitions' prefetch bursts. Daemon threads, not
  ``concurrent.futures``: a hung handler must not keep the interpreter from exiting after
  the member left its group.
- :class:`EventLoop`: one thread running asyncio, started on first use. A handler that
  returns an awaitable (an ``async def`` handler, an async ``__call__``, or a sync one
  returning a coroutine) has it awaited there while the calling thread waits for the
  result: N calling threads, up to N coroutines at once.

Threads. The controller makes both and closes them (``Partitions.close``); worker and pool
threads use them. :class:`HandlerPool`: ``submit`` puts work in a ``SimpleQueue`` that
the pool threads take from (``first`` ones from ``_ahead``, each with a token in
``_work`` that wakes a waiting thread); ``_busy`` is counted under ``_lock`` and read without it by
the HTTP scrape (``busy``, one int). :class:`EventLoop`: ``_loop`` is made, read and
cleared under ``_lock``; the loop thread owns the asyncio loop and every coroutine on it;
work crosses in with ``run_coroutine_threadsafe`` (the caller blocks on its
``concurrent.futures.Future``) and :meth:`EventLoop.close` stops it with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["EventLoop", "HandlerPool"]

log = logging.getLogger("partq.consumer.runners")
_AHEAD = object()  # in the pool's queue: work was put ahead of it (``submit(first=True)``)


class HandlerPool:
    """``size`` threads taking work from one queue; ``busy`` counts calls under way."""

    def __init__(self, size: int, name: str = "handler") -> None:
        if size < 1:
            raise ValueError(f"a handler pool needs at least 1 thread, got {size}")
        self._work: queue.SimpleQueue[Callable[[], None] | object | None] = queue.SimpleQueue()
        self._ahead: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy = 0
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
            for i in range(size)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def busy(self) -> int:
        return self._busy

    def submit(self, work: Callable[[], None], *, first: bool = False) -> None:
        """Run ``work`` on a free thread (queued until one is free); ``first``: on the next
        free thread, ahead of what is queued. ``work`` reports its own outcome and must not
        raise: what it raises is logged and dropped."""
        if first:
            self._ahead.put(work)
            self._work.put(_AHEAD)  # wakes a waiting thread, which takes it from _ahead
        else:
            self._work.put(work)

    def close(self) -> None:
        """Let every thread end once the work queued before is done (returns at once)."""
        for _ in self._threads:
            self._work.put(None)

    def _take(self) -> Callable[[], None] | None:
        """The next work: what was put ahead first; None: close."""
        while True:
            if not self._ahead.empty():
                with contextlib.suppress(queue.Empty):  # another thread may take it first
                    return self._ahead.get_nowait()
            work = self._work.get()
            if work is not _AHEAD:
                return work  # type: ignore[return-value]

    def _serve(self) -> None:
        while (work := self._take()) is not None:
            with self._lock:
                self._busy += 1
            try:
                work()
            except BaseException:  # work reports its own failures: this is a last resort
                log.exception("a handler pool task failed")
            finally:
                with self._lock:
                    self._busy -= 1


class EventLoop:
    """One asyncio loop on its own daemon thread, started by the first :meth:`wait`."""

    def __init__(self, name: str = "handler-loop") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def wait(self, awaitable: Awaitable[Any]) -> Any:
        """Await ``awaitable`` on the loop; its result, or what it raised, here (also
        ``SystemExit`` and ``KeyboardInterrupt``: a failure of that call, not of the loop)."""
        future = asyncio.run_coroutine_threadsafe(_awaited(awaitable), self._running())
        result, exiting = future.result()
        if exiting is not None:
            raise exiting
        return result

    def close(self) -> None:
        """Stop the loop (coroutines still pending are dropped with it)."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)

    def _running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()
                threading.Thread(
                    target=_serve, args=(loop, ready), name=self._name, daemon=True
                ).start()
                ready.wait()
                self._loop = loop
            return self._loop


def _serve(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(ready.set)
    try:
        loop.run_forever()
    finally:
        loop.close()


async def _awaited(awaitable: Awaitable[Any]) -> tuple[Any, BaseException | None]:
    """(its result, None), or (None, the SystemExit or KeyboardInterrupt it raised): asyncio
    re-raises those two out of ``run_forever``, which would close the loop under every
    other call and leave this one's caller waiting for ever."""
    try:
        return await awaitable, None
    except (SystemExit, KeyboardInterrupt) as exiting:
        return None, exiting

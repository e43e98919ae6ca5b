"""The producer SDK for asyncio: :class:`AsyncProducer` wraps one :class:`Producer`.

The contract (confirms, the window, republishing in order after a reconnect, the errors)
is the thread-based :class:`Producer`'s: this module adds no AMQP of its own.

Threads. The event loop's thread calls every method here and owns ``_waiting``,
``_space``, ``_idle`` and the counters. The Producer's I/O thread owns the connection and
settles its ``concurrent.futures`` futures (so do the executor thread running its close,
and the loop's thread for a message refused unsent), then reports them through
``on_settled``: it appends them to ``_settled`` (a deque, whose append and popleft are
atomic) and schedules at most one ``call_soon_threadsafe(_settle)`` at a time
(``_settle_scheduled``: a race schedules one call too many, never one too few), not one
per message or per confirm frame; :meth:`AsyncProducer._settle` then settles the matching
asyncio futures on the loop.

Nothing here blocks the loop: connecting and closing run in the loop's default executor;
a publish is handed to the Producer only when the window has room, so the Producer never
waits for space on the loop's thread (this module counts a message until the loop has
seen it settle, which is after the Producer stopped counting it); and the loop gets a
turn every ``_TURN`` messages handed over, counted across ``send`` and ``send_many`` calls
(a long batch is also checked a turn at a time).

Cost. Per message, on top of the Producer's own work, the loop's thread makes one
asyncio future (``send`` also a coroutine) and settles it: ``send`` and ``_settle`` call
nothing of this module per message, ``send_many`` makes its futures a chunk at a time,
and ``_settle`` reads a settled future's outcome from its fields (the slow path, a
failure or a cancelled await, is ``_settle_one``). ``benchmarks.publish_cost`` counts
the instructions per message against the Producer's (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any

from partq.producer.contract import StreamSpec
from partq.producer.futures import PublishFuture
from partq.producer.ledger import Receipt
from partq.producer.publisher import BatchItem, Producer

from partq.kernel.errors import ProducerClosed, UsageError

__all__ = ["AsyncProducer"]

log = logging.getLogger("partq.producer")

_TURN = 128  # messages handed over (or checked) between two turns of the event loop (256 held
# the loop for up to 33 ms of CPU at load 2-4: tests/integration/test_async_producer.py)


class AsyncProducer:
    """Publish keyed messages to a partq stream from asyncio code.

    >>> async with AsyncProducer("orders") as producer:     # doctest: +SKIP
    ...     receipt = await producer.publish("user-1", b"hello")

    It takes :class:`Producer`'s arguments (``amqp_url``, ``etcd``, ``partitions``,
    ``window``, ``connect_timeout``, ``reconnect_timeout``, ``name``), connects in
    :meth:`open` (or ``async with``) and raises the same errors. ``publish`` and
    ``publish_many`` return once the broker has confirmed; ``send`` and ``send_many``
    return once the messages are handed over (after waiting for room in the window),
    with an asyncio future per message. Call it from the event loop that opened it.

    Cancelling an await stops the wait, not the message: a message handed over before
    the cancellation is still published, confirmed and, after a reconnect, republished
    in order; :meth:`flush` and :meth:`close` wait for it, and if it fails the failure
    is logged. A ``publish`` cancelled while it waits for room in the window sends
    nothing; a cancelled ``publish_many`` may have handed over the first part of its
    batch, in order, and sends nothing after that.
    """

    def __init__(self, stream: str | StreamSpec, **options: Any) -> None:
        # Producer's own signature checks the options now (a TypeError names a wrong one)
        # and gives the defaults: its arguments are listed in one place.
        bound = inspect.signature(Producer).bind(stream, on_settled=self._on_settled, **options)
        bound.apply_defaults()
        self._window: int = bound.arguments["window"]  # Producer refuses one below 1
        self._low_water = self._window - max(1, min(self._window // 4, _TURN))
        self._connect = functools.partial(Producer, *bound.args, **bound.kwargs)
        self._producer: Producer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._new_future: Callable[[], asyncio.Future[Any]] = _not_open_future
        # Each handed-over message's Producer future -> the asyncio future given out.
        self._waiting: dict[Future[Receipt], asyncio.Future[Receipt]] = {}
        self._space: deque[asyncio.Future[None]] = deque()  # waiting for room in the window
        self._idle: list[asyncio.Future[None]] = []  # waiting for nothing in flight
        self._since_turn = 0
        # Settled futures on their way from the Producer's threads to the loop (a deque's
        # append and popleft are thread-safe), and whether a _settle call is scheduled.
        self._settled: deque[Sequence[PublishFuture[Receipt]]] = deque()
        self._settle_scheduled = False

    @property
    def spec(self) -> StreamSpec:
        return self._open().spec

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> AsyncProducer:
        """Read the stream's spec and connect (in an executor: the loop keeps running)."""
        if self._producer is not None:
            return self
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._new_future = loop.create_future
        connecting = loop.run_in_executor(None, self._connect)
        try:
            self._producer = await asyncio.shield(connecting)
        except asyncio.CancelledError:
            connecting.add_done_callback(_close_when_made)  # nobody else will close it
            raise
        return self

    async def close(self, timeout: float | None = 30.0) -> None:
        """Flush (for at most ``timeout`` seconds), then close; what is pending then fails
        with :class:`ProducerClosed`. The Producer's close runs in an executor, to its end
        even if this await is cancelled."""
        producer = self._producer
        if producer is None:
            return
        closing = asyncio.get_running_loop().run_in_executor(None, producer.close, timeout)
        # Its on_settled calls were scheduled before the executor's result: once this
        # returns, every asyncio future of this producer is settled.
        await asyncio.shield(closing)

    async def __aenter__(self) -> AsyncProducer:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"Async{self._producer!r}" if self._producer else "AsyncProducer(not open)"

    # -- publishing --------------------------------------------------------------------------

    async def publish(
        self,
        key: str | bytes,
        body: bytes | str,
        *,
        headers: Mapping[str, Any] | None = None,
        message_id: str | None = None,
    ) -> Receipt:
        """Publish one message and return its :class:`Receipt` once the broker confirmed it.

        Raises as :meth:`Producer.publish` does (``TypeError``, :class:`UsageError`,
        :class:`ProducerClosed`) and as its future fails (:class:`PublishFailed`)."""
        return await (await self.send(key, body, headers=headers, message_id=message_id))

    async def send(
        self,
        key: str | bytes,
        body: bytes | str,
        *,
        headers: Mapping[str, Any] | None = None,
        message_id: str | None = None,
    ) -> asyncio.Future[Receipt]:
        """Hand one message over (waiting for room in the window) and return a future
        that resolves to its :class:`Receipt` when the broker confirms it."""
        # The hot path of a loop of sends: no call of this module's own, one asyncio future
        producer = self._producer
        if producer is None:
            raise _not_open()
        if self._since_turn >= _TURN or len(self._waiting) >= self._window:
            self._since_turn = 0
            await self._room()
        self._since_turn += 1
        future = producer.publish(key, body, headers=headers, message_id=message_id)
        waiter = self._waiting[future] = self._new_future()
        return waiter

    async def publish_many(self, messages: Iterable[BatchItem]) -> list[Receipt]:
        """Publish a batch (the tuples :meth:`Producer.publish_many` takes) and return
        each message's receipt, in order, once every one is settled. If any failed, the
        first failure in batch order is raised; :meth:`send_many` gives each message's own
        outcome."""
        futures = await self.send_many(messages)
        try:
            for future in futures:  # one at a time: asyncio.wait(futures) holds the loop O(n)
                if not future.done():
                    with contextlib.suppress(Exception):  # each outcome is read below, in order
                        await future
        except asyncio.CancelledError:
            _stop_waiting(futures)
            raise
        errors = [future.exception() for future in futures]  # all retrieved: none is logged
        for error in errors:
            if error is not None:
                raise error
        return [future.result() for future in futures]

    async def send_many(self, messages: Iterable[BatchItem]) -> list[asyncio.Future[Receipt]]:
        """Check every message, then hand them over in order as the window makes room, and
        return one future per message. As :meth:`Producer.publish_many`: a message it would
        refuse raises here and none of the batch is sent."""
        producer = self._open()
        items = list(messages)
        now = time.time()
        prepared = producer._prepare_batch(items[:_TURN], now)
        for start in range(_TURN, len(items), _TURN):
            await asyncio.sleep(0)  # a long batch is checked a turn at a time
            prepared += producer._prepare_batch(items[start : start + _TURN], now)
        futures: list[asyncio.Future[Receipt]] = []
        new_future = self._new_future
        try:
            while len(futures) < len(prepared):
                if self._since_turn >= _TURN or len(self._waiting) >= self._window:
                    self._since_turn = 0  # the turn is shared with send: not one per batch
                    await self._room()
                left = len(prepared) - len(futures)
                take = min(_TURN, self._window - len(self._waiting), left)
                chunk = prepared[len(futures) : len(futures) + take]
                try:
                    handed = producer._hand_over(chunk)
                except ProducerClosed as closed:
                    if not futures:
                        raise
                    futures += [self._failed(closed) for _ in range(left)]
                    break
                waiters = [new_future() for _ in handed]
                self._waiting.update(zip(handed, waiters, strict=True))
                futures += waiters
                self._since_turn += take
        except asyncio.CancelledError:
            _stop_waiting(futures)  # handed over already: they go on, failures are logged
            raise
        return futures

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every message handed over so far is confirmed or failed."""
        self._open()
        if not self._waiting:
            return
        idle = asyncio.get_running_loop().create_future()
        self._idle.append(idle)
        try:
            await asyncio.wait_for(idle, timeout)
        except TimeoutError:
            raise TimeoutError(
                f"{len(self._waiting)} messages still unconfirmed after {timeout}s"
            ) from None

    # -- the loop's side of the bridge -------------------------------------------------------

    def _open(self) -> Producer:
        if self._producer is None:
            raise _not_open()
        return self._producer

    async def _room(self) -> None:
        """Give the loop a turn, and wait until the window has room for one more message."""
        await asyncio.sleep(0)
        while len(self._waiting) >= self._window:
            space = asyncio.get_running_loop().create_future()
            self._space.append(space)
            await space

    def _failed(self, error: BaseException) -> asyncio.Future[Receipt]:
        assert self._loop is not None
        waiter: asyncio.Future[Receipt] = self._loop.create_future()
        waiter.set_exception(error)
        return waiter

    def _on_settled(self, futures: Sequence[PublishFuture[Receipt]]) -> None:
        """The Producer's side (any thread): hand the settled futures to the loop, waking it
        only if no hand-over is scheduled yet (confirm frames carry a few messages each)."""
        self._settled.append(futures)
        loop = self._loop
        if loop is None or self._settle_scheduled:
            return
        self._settle_scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            loop.call_soon_threadsafe(self._settle)

    def _settle(self) -> None:
        # The flag goes down before the queue is read: what is added after the last read
        # schedules another call, and what was added before it is read here.
        self._settle_scheduled = False
        waiting, settled = self._waiting, self._settled
        while settled:
            for future in settled.popleft():  # per message: no call of this module's own
                waiter = waiting.pop(future, None)
                if waiter is None:  # refused before it was handed over: the caller got the error
                    continue
                # Settled futures only: reading the outcome needs no Future method
                if future._exception is None and not waiter.done():
                    waiter.set_result(future._result)
                else:
                    _settle_one(future, waiter)
        # Room for a few messages at least, so that a full window does not wake a publisher for
        # every confirm frame
        while self._space and len(self._waiting) <= self._low_water:
            space = self._space.popleft()
            if not space.done():
                space.set_result(None)
        if not self._waiting:
            for idle in self._idle:
                if not idle.done():
                    idle.set_result(None)
            self._idle.clear()


def _settle_one(future: PublishFuture[Receipt], waiter: asyncio.Future[Receipt]) -> None:
    """A message that failed, or whose await was cancelled (the message went on without it)."""
    error = future.exception()
    if waiter.done():
        if error is not None:
            log.warning("a message whose publish was cancelled failed: %s", error)
    elif error is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(future.result())


def _not_open() -> UsageError:
    return UsageError(
        "the AsyncProducer is not open: use `async with AsyncProducer(...)` "
        "or `await producer.open()` first"
    )


def _not_open_future() -> asyncio.Future[Any]:
    raise _not_open()


def _stop_waiting(futures: list[asyncio.Future[Receipt]]) -> None:
    """The caller stopped waiting: cancel its futures, so that _settle logs a failure."""
    for future in futures:
        if not future.cancel() and not future.cancelled() and future.exception() is not None:
            log.warning("a message whose publish was cancelled failed: %s", future.exception())


def _close_when_made(connecting: asyncio.Future[Producer]) -> None:
    """``open`` was cancelled while the Producer was being made: close it once it is."""
    if connecting.cancelled() or connecting.exception() is not None:
        return
    producer = connecting.result()
    asyncio.get_running_loop().run_in_executor(None, producer.close)

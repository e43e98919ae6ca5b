"""The member's workers: how each is made, what they share, and the wait before a fence.

:class:`Crew` makes a partition's worker (:class:`partq.consumers.handling.worker.Worker`,
or :class:`partq.consumers.handling.keyed.KeyedWorker` on one shared
:class:`HandlerPool` above concurrency 1), each of a new subscription generation, and
owns what they share: the handler and its settings, the pool, the event loop that awaits
async handlers. Which worker consumes which partition is the slots' (``slot.hire``).

Threads. Made, used and closed on the daemon's controller thread
(``partq.consumers.control.partitions``); the pool's and the loop's threads run the
workers' handler calls. :meth:`Crew.in_flight` and :meth:`Crew.longest_wait` are also
called from the HTTP server thread's Prometheus scrape, on a list of workers the caller
read once; they read the pool's ``busy`` or each worker's ``busy`` / ``longest_wait``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable

from partq.consumers.broker.deadletters import DeadLetters
from partq.consumers.broker.port import BrokerPort
from partq.consumers.control.resizing import ResizeGate
from partq.consumers.control.slot import PartitionSlot
from partq.consumers.handling.keyed import KeyedWorker
from partq.consumers.handling.message import Handler
from partq.consumers.handling.parking import Parking
from partq.consumers.handling.runners import EventLoop, HandlerPool
from partq.consumers.handling.watchdog import Watchdogs
from partq.consumers.handling.worker import Worker
from partq.coordinator.store.session import Session
from partq.producer.contract import StreamSpec

__all__ = ["Crew"]

log = logging.getLogger("partq.consumer")


class Crew:
    """The member's workers (the module docstring)."""

    def __init__(
        self,
        *,
        member: str,
        handler: Handler,
        broker: BrokerPort,
        dead_letters: DeadLetters,
        max_attempts: int,
        retry_backoff: float,
        handler_timeout: float | None,
        on_failure: Callable[[int, str], None],
        parking: Parking | None,
        resize: ResizeGate | None,
        concurrency: int,
        fence_wait: float,
    ) -> None:
        self.handler = handler
        self.concurrency = concurrency  # 1: a Worker per partition; above: KeyedWorkers
        self.fence_wait = fence_wait  # seconds a fence waits for handler calls under way
        self._generations = itertools.count(1)  # of subscriptions: one per worker made
        self.loop = EventLoop()  # awaits what async handlers return, for every partition
        self.pool = HandlerPool(concurrency, f"handler-{member}") if concurrency > 1 else None
        kind: Callable[..., Worker] = (
            Worker if self.pool is None else functools.partial(KeyedWorker, pool=self.pool)
        )
        # what every worker of the member is made with (resize: the gate each asks)
        self._make = functools.partial(
            kind,
            member=member,
            broker=broker,
            dead_letters=dead_letters,
            max_attempts=max_attempts,
            retry_backoff=retry_backoff,
            handler_timeout=handler_timeout,
            on_failure=on_failure,
            parking=parking,
            loop=self.loop,
            resize=resize,
            # one watchdog thread for every worker of the member
            watchdogs=Watchdogs(handler_timeout) if handler_timeout else None,
        )

    def hire(
        self,
        slot: PartitionSlot,
        spec: StreamSpec,
        session: Session | None,
        fencing_token: int,
        *,
        start: bool = True,
    ) -> Worker:
        """The next worker of ``slot``'s partition, of a new generation; started unless
        ``start`` is False (the caller subscribes first: its inbox takes deliveries before
        its thread runs). ``fencing_token``: our claim's revision now."""
        worker = slot.hire(
            lambda previous, freed_at: self._make(
                spec=spec,
                partition=slot.partition,
                handler=self.handler,
                session=session,
                previous=previous,
                freed_at=freed_at,
                generation=next(self._generations),
                fencing_token=fencing_token,
            )
        )
        if start:
            worker.start()
        return worker

    def in_flight(self, workers: list[Worker]) -> int:
        """Messages of this member in a handler now (one per busy worker without a pool)."""
        if self.pool is not None:
            return self.pool.busy
        return sum(1 for worker in workers if worker.busy)

    @staticmethod
    def longest_wait(workers: list[Worker]) -> float:
        return max((w.longest_wait for w in workers if isinstance(w, KeyedWorker)), default=0.0)

    def await_handlers(self, workers: list[Worker]) -> None:
        """Stop ``workers`` for a fence and wait for their handler calls under way, up to
        ``fence_wait`` seconds; a call still running then is left running, and logged."""
        for worker in workers:
            worker.stop(fence=True)
        deadline = time.monotonic() + self.fence_wait
        running = [
            w.partition
            for w in workers
            if not w.wait_handlers(max(0.0, deadline - time.monotonic()))
        ]
        if running:
            log.warning(
                "partitions %s: a handler call is still under way %gs after the fence began: "
                "fencing anyway; the next owner may handle beside it",
                running,
                self.fence_wait,
            )

    def close(self) -> None:
        """The member is done: end the handler pool's threads and the event loop."""
        if self.pool is not None:
            self.pool.close()
        self.loop.close()

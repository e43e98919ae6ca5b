"""One Spark task's publishes: rows in per-partition order, pipelined confirms, all or fail.

A task publishes the rows Spark gives it through the producer SDK, with the
stream's spec passed in (executors read etcd only when a resize returned their
publishes: :class:`~partq.producer.spark.options.TaskSpecs`), and returns only after
the broker confirmed every message. If any message is not confirmed the task
raises :class:`PublishFailed`; Spark then retries the task or fails the batch,
which is never committed. A retried task publishes the same messages with the
same ids (see :mod:`partq.producer.spark.replay`).

Order. Every partq partition of a batch is published by exactly one task
(``prepare()`` repartitions by partition). Within the task the rows are put in
(partition, order column, source position) order — by sorting them here, or,
when Spark sorted them already (``presorted``), as they come — and numbered per
partition: that number is the message's ``seq``. The SDK publishes them on one
channel in that order (``publish_many``, a batch at a time), so each queue receives a
key's rows in order.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from partq.producer.contract import StreamSpec
from partq.producer.ledger import Receipt
from partq.producer.publisher import BatchItem, Producer
from partq.producer.spark.options import SinkOptions, TaskSpecs
from partq.producer.spark.replay import message_id, replay_headers
from partq.producer.spark.rows import Outgoing, RowLayout
from pyspark.sql.datasource import WriterCommitMessage

from partq.kernel.errors import PublishFailed, UsageError

__all__ = ["TaskReport", "check_one_task_per_partition", "publish_task", "rerouted_note"]

_BATCH = 256  # messages per Producer.publish_many: one lock and wake-up per batch, not per row


@dataclass(frozen=True)
class TaskReport(WriterCommitMessage):
    """What a task tells the driver: it published and got confirms for ``rows`` rows."""

    task: int
    rows: int
    partitions: tuple[int, ...]  # as prepare() grouped the rows
    seconds: float
    epoch: int = 0  # of the layout the task published under last
    rerouted: int = 0  # returned by a resize's cut and republished under a newer layout


def _in_order(
    rows: Iterable[Sequence[Any]], layout: RowLayout, presorted: bool
) -> Iterator[Outgoing]:
    if presorted:
        return (layout.message(row) for row in rows)
    # Build (and check) every message before the first publish: a bad row fails the
    # task before anything of it reaches the broker.
    keyed = [(layout.sort_key(row), layout.message(row)) for row in rows]
    keyed.sort(key=itemgetter(0))
    return (message for _, message in keyed)


class _Confirms:
    """A task's publish futures, checked by the publishing thread as they complete.

    Checking here rather than in done-callbacks keeps work off the producer's I/O
    thread, which is what limits a task's rate; memory stays bounded by ``limit``.
    """

    def __init__(self, limit: int) -> None:
        self._pending: deque[Future[Receipt]] = deque()
        self._limit = limit
        self.failed = 0
        self.first_error: BaseException | None = None

    def add(self, future: Future[Receipt]) -> None:
        self._pending.append(future)
        if len(self._pending) >= self._limit:
            self._reap()

    def add_all(self, futures: list[Future[Receipt]]) -> int:
        """Add a batch's futures; how many."""
        for future in futures:
            self.add(future)
        return len(futures)

    def check_all(self) -> None:
        """Count every failure; after ``Producer.close`` every future is done."""
        self._reap()
        self.failed += len(self._pending)  # not done: not confirmed
        self._pending.clear()

    def _reap(self) -> None:
        pending = self._pending
        while pending and pending[0].done():
            error = pending.popleft().exception()
            if error is not None:
                self.failed += 1
                self.first_error = self.first_error or error


def publish_task(
    rows: Iterable[Sequence[Any]],
    *,
    layout: RowLayout,
    spec: StreamSpec,
    options: SinkOptions,
    query_id: str,
    batch_id: int,
    task: int,
    presorted: bool = False,
) -> TaskReport:
    """Publish ``rows``; return once all are confirmed, raise if any is not."""
    started = time.monotonic()
    messages = _in_order(rows, layout, presorted)
    first = next(messages, None)
    if first is None:  # nothing to publish: no connection needed
        return TaskReport(task, 0, (), time.monotonic() - started)
    confirms = _Confirms(2 * options.window)
    seqs: dict[int, int] = {}
    sent = 0
    producer = Producer(
        spec,
        amqp_url=options.amqp_url,
        etcd=TaskSpecs(options),
        window=options.window,
        name=f"partq-spark-task-{task}",
    )
    try:
        batch: list[BatchItem] = []
        for message in itertools.chain((first,), messages):
            seq = seqs.get(message.partition, 0)
            seqs[message.partition] = seq + 1
            headers: dict[str, Any] = dict(message.headers) if message.headers else {}
            headers.update(replay_headers(query_id, batch_id, seq))
            mid = message_id(query_id, batch_id, message.partition, seq)
            batch.append((message.key, message.body, headers, mid))
            if len(batch) >= _BATCH:
                sent += confirms.add_all(producer.publish_many(batch))
                batch = []
                if confirms.failed:
                    break  # the task fails anyway: stop publishing
        else:
            sent += confirms.add_all(producer.publish_many(batch)) if batch else 0
            try:
                producer.flush(options.confirm_timeout)
            except TimeoutError:
                raise PublishFailed(
                    f"batch {batch_id}: the broker did not confirm every message within "
                    f"{options.confirm_timeout:.0f}s (option confirmTimeout); the task fails so "
                    f"that Spark retries it, and the batch is not committed"
                ) from None
    finally:
        producer.close(timeout=5)
    confirms.check_all()
    if confirms.failed:
        raise PublishFailed(
            f"batch {batch_id}: {confirms.failed} of {sent} messages to stream {spec.name!r} "
            f"were not confirmed (first: {confirms.first_error}); the task fails so that Spark "
            f"retries it, and the batch is not committed"
        )
    return TaskReport(
        task,
        sent,
        tuple(sorted(seqs)),
        time.monotonic() - started,
        producer.spec.epoch,
        producer.rerouted,
    )


def rerouted_note(reports: Iterable[TaskReport | None]) -> str:
    """What a batch's tasks republished after a resize returned it ("" when nothing)."""
    done = [report for report in reports if report is not None and report.rerouted]
    if not done:
        return ""
    rerouted = sum(report.rerouted for report in done)
    epoch = max(report.epoch for report in done)
    return f"; {rerouted} returned by a resize and republished under layout epoch {epoch}"


def check_one_task_per_partition(reports: Iterable[TaskReport | None], batch_id: int) -> int:
    """Rows of the batch; raise if two tasks published one partition (order is then lost)."""
    owner: dict[int, int] = {}
    rows = 0
    for report in reports:
        if report is None:
            continue
        rows += report.rows
        for partition in report.partitions:
            if partition in owner:
                raise UsageError(
                    f"batch {batch_id}: partition {partition} was published by tasks "
                    f"{owner[partition]} and {report.task}, so its order and message ids are "
                    f"not reliable: do not repartition the DataFrame after "
                    f"partq.producer.spark.prepare()"
                )
            owner[partition] = report.task
    return rows

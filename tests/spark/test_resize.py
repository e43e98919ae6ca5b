"""The partq sink across a resize: a running query follows the new layout (docs/resize.md).

A query publishes keyed rows file by file with its spec pinned (as ``partq spark-job``
does) while the stream grows 8 -> 16. The resize is held right after its cut until a
write task of the query has been running for a second: its publishes were returned by
the broker, and it waits for the newer layout. Then the resize goes on to its switch and
the query keeps going. Read back from every queue: nothing of the old layout behind a
fence, every row once, each key's old-layout rows before its new-layout ones, in order.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
from partq.coordinator.leader.resize import Phase, State
from partq.coordinator.leader.resizer import Resizer
from partq.producer.contract import (
    HEADER_CONTROL,
    HEADER_PUBLISHED_MS,
    StreamSpec,
    decode_key,
)
from partq.producer.layout import Layout
from partq.producer.registry import Registry
from partq.producer.spark import SinkOptions, failure_reason, prepare
from pyspark.sql import SparkSession

from partq.kernel.settings import Settings
from tests.polling import wait_until
from tests.spark.conftest import (
    ROW_SCHEMA,
    Delivered,
    committed_batches,
    keyed_rows,
    read_all,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow]

FILES = 10  # one per micro-batch
ROWS_PER_FILE = 400
KEYS = 200
BEFORE = 3  # files published before the resize
DURING = 2  # files given to the query while the resize is held after its cut
GROWN = 16
_EPOCH = time.time() - 3600  # the files' modification times: _EPOCH + n


def _write_files(directory: Path, first: int, last: int) -> None:
    """Files ``first`` … ``last - 1`` of the rows, each one micro-batch (the file source
    takes files in modification-time order: file n is n seconds after file 0)."""
    rows = keyed_rows(FILES * ROWS_PER_FILE, KEYS)
    for n in range(first, last):
        lines = [json.dumps(row) for row in rows[n * ROWS_PER_FILE : (n + 1) * ROWS_PER_FILE]]
        staging = directory / f".part-{n:03d}.json.tmp"
        staging.write_text("\n".join(lines) + "\n")
        os.utime(staging, (_EPOCH + n, _EPOCH + n))
        staging.rename(directory / f"part-{n:03d}.json")  # appears whole to the file source


class _LongTask:
    """Whether one stage has had a running task for ``seconds`` (polled): a task of 400
    rows publishes in milliseconds, one whose publishes were returned waits for a layout."""

    def __init__(self, spark: SparkSession, seconds: float) -> None:
        self._tracker = spark.sparkContext.statusTracker()
        self._seconds = seconds
        self._since: dict[int, float] = {}

    def __call__(self) -> bool:
        now = time.monotonic()
        running = set()
        for stage in self._tracker.getActiveStageIds():
            info = self._tracker.getStageInfo(stage)
            if info is not None and info.numActiveTasks > 0:
                running.add(stage)
                self._since.setdefault(stage, now)
        self._since = {stage: t for stage, t in self._since.items() if stage in running}
        return any(now - t >= self._seconds for t in self._since.values())


def test_a_running_query_follows_a_resize_and_never_writes_the_old_layout_after_its_cut(
    spark: SparkSession,
    spark_stream: StreamSpec,
    registry: Registry,
    settings: Settings,
    rabbitmq: str,
    tmp_path: Path,
) -> None:
    # Given a query publishing one file per micro-batch, its spec pinned
    source, checkpoint = tmp_path / "in", tmp_path / "chk"
    source.mkdir()
    _write_files(source, 0, BEFORE)
    options = SinkOptions(
        spark_stream.name,
        "key",
        order_column="order",
        etcd_endpoints=settings.etcd_endpoints,
        amqp_url=settings.amqp.url,
        partitions=spark_stream.partitions,
    ).pinned()
    frame = spark.readStream.schema(ROW_SCHEMA).option("maxFilesPerTrigger", 1).json(str(source))
    query = (
        prepare(frame, spark_stream, "key", "order")
        .writeStream.format("partq")
        .options(**options.to_options())
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    cut, release = threading.Event(), threading.Event()
    released_ms = 0
    errors: list[BaseException] = []

    def held(state: State) -> None:
        if state.phase is Phase.CUT:  # the old bindings are gone; no fence, no new binding
            cut.set()
            assert release.wait(120), "the test never released the resize"

    def resize() -> None:
        try:
            resizer = Resizer(registry, rabbitmq, spark_stream.name, written=held)
            resizer.start(GROWN)
            resizer.run(Phase.SWITCHED, 120)
        except BaseException as e:
            errors.append(e)
            cut.set()

    try:
        wait_until(lambda: len(committed_batches(checkpoint)) == BEFORE, 120, 0.1,
                   what="the batches before the resize")  # fmt: skip
        # When the stream grows 8 -> 16, held after its cut while the query publishes a batch
        resizing = threading.Thread(target=resize, name="resize")
        resizing.start()
        assert cut.wait(60) and not errors, errors
        _write_files(source, BEFORE, BEFORE + DURING)
        waits = _LongTask(spark, 1.0)
        wait_until(lambda: query.exception() is not None or waits(), 60, 0.05,
                   what="a write task waiting for the layout")  # fmt: skip
        assert query.exception() is None, failure_reason(str(query.exception()))
        released_ms = int(time.time() * 1000)
        release.set()
        resizing.join(120)
        assert not resizing.is_alive() and not errors, errors
        # And the query goes on with the rest
        _write_files(source, BEFORE + DURING, FILES)
        wait_until(lambda: len(committed_batches(checkpoint)) == FILES, 180, 0.1,
                   what="every batch")  # fmt: skip
        assert query.exception() is None
    finally:
        release.set()
        query.stop()

    # Then the stream is grown, and every queue holds what its layout routed to it
    assert registry.read_spec(spark_stream.name).layout == Layout(GROWN, 1)
    queues = read_all(settings.amqp, StreamSpec(spark_stream.name, GROWN))
    by_key: dict[str | bytes, list[tuple[int, Delivered]]] = defaultdict(list)
    for partition, messages in sorted(queues.items()):
        fences = [i for i, m in enumerate(messages) if m.headers.get(HEADER_CONTROL) == "fence"]
        assert len(fences) == (1 if partition < spark_stream.partitions else 0), partition
        fence = fences[0] if fences else -1
        for i, m in enumerate(messages):
            if i == fence:
                continue
            epoch = 0 if i < fence else 1
            layout = Layout(spark_stream.partitions, 0) if epoch == 0 else Layout(GROWN, 1)
            # Nothing of the old layout behind its queue's fence
            assert m.routing_key == layout.routing_key(partition), (partition, i)
            key = decode_key(m.headers)
            assert key is not None
            assert layout.partition_for(key) == partition
            by_key[key].append((epoch, m))
    # every row exactly once
    orders = sorted(m.row["order"] for ms in by_key.values() for _, m in ms)
    assert orders == list(range(FILES * ROWS_PER_FILE))
    # each key's old-layout rows, then its new-layout rows, in order
    for key, ms in by_key.items():
        ms.sort(key=lambda em: em[0])  # stable: queue order within each epoch
        assert [m.row["order"] for _, m in ms] == sorted(m.row["order"] for _, m in ms), key
    old = sum(1 for ms in by_key.values() for epoch, _ in ms if epoch == 0)
    assert old >= BEFORE * ROWS_PER_FILE
    # and the batch held at the cut was returned and republished under the new layout
    rerouted = sum(
        1
        for ms in by_key.values()
        for epoch, m in ms
        if epoch == 1 and int(m.headers[HEADER_PUBLISHED_MS]) < released_ms
    )
    print(f"old layout {old}, new layout {FILES * ROWS_PER_FILE - old}, rerouted {rerouted}")
    assert rerouted > 0

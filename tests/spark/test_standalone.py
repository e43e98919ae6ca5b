"""``partq spark-job --master spark://…`` on a Spark standalone master and worker (started
with pyspark's own ``spark-class``, tests/cluster.py), and a kill -9 of the worker in the
middle of a batch: the job goes on when a new worker registers, nothing is lost, and
every extra copy is an identifiable replay of the batch the kill interrupted."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from partq.producer.contract import StreamSpec

from partq.kernel.settings import Settings
from tests.cluster import SparkStandalone
from tests.spark.conftest import (
    assert_every_row_once_but_replays,
    committed_batches,
    file_job_args,
    job_process,
    keyed_rows,
    queue_depths,
    wait_for_job,
    write_json_rows,
)

pytestmark = [pytest.mark.spark, pytest.mark.fault, pytest.mark.slow]

FILES = 4
ROWS_PER_FILE = 4_000
ROWS = FILES * ROWS_PER_FILE


def test_killing_the_spark_worker_mid_batch_loses_nothing(
    spark_stream: StreamSpec, settings: Settings, tmp_path: Path
) -> None:
    # Given a standalone master with one worker, and 16 000 keyed rows in 4 files
    write_json_rows(tmp_path / "in", keyed_rows(ROWS, 500), FILES)
    checkpoint = tmp_path / "chk"
    with SparkStandalone(tmp_path / "spark") as spark:
        args = file_job_args(
            settings, spark_stream, tmp_path / "in", checkpoint, "--master", spark.url
        )
        log = tmp_path / "job.log"

        def depth() -> int:
            return sum(queue_depths(settings.amqp, spark_stream))

        with job_process(args, log) as job:
            # When the worker (with its executor) is killed -9 while a batch is published
            wait_for_job(lambda: depth() % ROWS_PER_FILE > 0, "a batch in flight", 240, job)
            spark.kill_worker(spark.workers[0])
            killed_at = time.monotonic()
            in_flight = depth() // ROWS_PER_FILE
            assert 0 < depth() < ROWS
            # Then, once a new worker registers, the batch is done again and the rest follows
            spark.start_worker()
            done = f"batch {in_flight}: {ROWS_PER_FILE} rows published"
            wait_for_job(lambda: done in log.read_text(), "the interrupted batch", 240, job)
            recovered = time.monotonic() - killed_at
            last = f"batch {FILES - 1}: {ROWS_PER_FILE} rows published"
            wait_for_job(lambda: last in log.read_text(), "the last batch", 240, job)
            assert committed_batches(checkpoint) == list(range(FILES))
        # And no row is lost; extra copies are replays of the interrupted batch only
        replayed = assert_every_row_once_but_replays(settings.amqp, spark_stream, ROWS, {in_flight})
        lost_executor = re.search(r"[Ll]ost executor|ExecutorLost", log.read_text())
        print(
            f"\nworker killed in batch {in_flight}: batch done again {recovered:.1f}s after "
            f"the kill (a new worker started at once); {len(replayed)} rows replayed; 0 lost"
            f"{'' if lost_executor else ' (no executor-loss line in the job log)'}"
        )

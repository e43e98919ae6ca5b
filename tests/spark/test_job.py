"""``partq spark-job`` as a real process: killed mid-batch with SIGKILL, restarted, stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
from partq.producer.contract import StreamSpec

from partq.kernel.local import free_port
from partq.kernel.settings import Settings
from tests.cluster import kill_session
from tests.spark.conftest import (
    PARTQ,
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


def test_a_job_killed_mid_batch_resumes_from_its_checkpoint_with_identifiable_replays(
    spark_stream: StreamSpec, settings: Settings, tmp_path: Path
) -> None:
    # Given 16 000 keyed rows in 4 files, one file per micro-batch
    write_json_rows(tmp_path / "in", keyed_rows(ROWS, 500), FILES)
    checkpoint = tmp_path / "chk"
    metrics_port = free_port()
    args = file_job_args(
        settings, spark_stream, tmp_path / "in", checkpoint,
        "--partitions", str(spark_stream.partitions),
        "--metrics-port", str(metrics_port),
        "--metrics-addr", "127.0.0.1",
    )  # fmt: skip
    log = tmp_path / "job.log"

    def depth() -> int:
        return sum(queue_depths(settings.amqp, spark_stream))

    # When the job is SIGKILLed while a batch is being published
    with job_process(args, log) as first:
        wait_for_job(lambda: depth() % ROWS_PER_FILE > 0, "for a batch in flight", 240, first)
        os.killpg(first.pid, signal.SIGKILL)
        kill_session(first.pid)
    in_flight = depth() // ROWS_PER_FILE  # the batch that was being published
    assert 0 < depth() < ROWS
    assert committed_batches(checkpoint) == list(range(in_flight)), "a half batch was committed"

    # And restarted with the same checkpoint, then stopped with SIGTERM once all is committed
    with job_process(args, log) as second:
        last_batch = f"batch {FILES - 1}: {ROWS_PER_FILE} rows published"
        wait_for_job(lambda: last_batch in log.read_text(), "for the last batch", 240, second)
        assert committed_batches(checkpoint) == list(range(FILES))
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as response:
            exported = response.read().decode()
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0, log.read_text()[-3000:]
    output = log.read_text()
    assert "SIGTERM received, stopping the query" in output
    published = f'partq_spark_rows_published_total{{stream="{spark_stream.name}"}}'
    assert published in exported

    # Then no row is missing, and every extra copy is a replay of the killed batch
    replayed = assert_every_row_once_but_replays(settings.amqp, spark_stream, ROWS, {in_flight})
    assert replayed, "the killed batch published nothing before the kill"


def test_the_job_refuses_a_partition_count_that_disagrees_with_etcd(
    spark_stream: StreamSpec, settings: Settings, tmp_path: Path
) -> None:
    # Given a job told to expect 3 partitions of an 8-partition stream
    # When it starts
    args = [
        "--etcd-endpoints", settings.etcd_endpoints,
        "--amqp-url", settings.amqp.url,
        "spark-job",
        "--stream", spark_stream.name,
        "--rate", "10",
        "--checkpoint", str(tmp_path / "chk"),
        "--partitions", "3",
    ]  # fmt: skip
    result = subprocess.run([PARTQ, *args], capture_output=True, text=True, timeout=60, check=False)
    # Then it exits with a usage error before Spark starts, and nothing is published
    assert result.returncode == 2, result.stderr
    assert "has 8 partitions in etcd, but option partitions=3" in result.stderr
    assert not (tmp_path / "chk").exists()
    assert sum(queue_depths(settings.amqp, spark_stream)) == 0

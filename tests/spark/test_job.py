"""``partq spark-job`` as a real process: killed mid-batch with SIGKILL, restarted, stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from kernel.local import free_port
from kernel.settings import Settings
from producer.contract import StreamSpec
from producer.spark import ReplayId
from tests.spark.conftest import (
    FAST_JVM,
    ROW_SCHEMA,
    SPARK_CONF,
    Delivered,
    committed_batches,
    keyed_rows,
    queue_depths,
    read_all,
    write_json_rows,
)

pytestmark = [pytest.mark.spark, pytest.mark.fault, pytest.mark.slow]

FILES = 4
ROWS_PER_FILE = 4_000
ROWS = FILES * ROWS_PER_FILE
PARTQ = str(Path(sys.executable).parent / "partq")


def _session_processes(session: int) -> list[int]:
    """Processes of the session ``session`` (the job, its JVM, Spark's Python workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":  # a zombie is dead already
            pids.append(int(entry.name))
    return pids


def _kill_session(session: int) -> None:
    """SIGKILL every process of a job we started in its own session, by id."""
    deadline = time.monotonic() + 30
    while (pids := _session_processes(session)) and time.monotonic() < deadline:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    assert not _session_processes(session), "the job's processes did not die"


@contextmanager
def _job(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        process = subprocess.Popen(
            [PARTQ, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **FAST_JVM},
        )
    try:
        yield process
    finally:
        _kill_session(process.pid)
        process.wait()


def _wait(condition: object, what: str, timeout: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        assert process.poll() is None, f"the job exited ({process.returncode}) while waiting {what}"
        time.sleep(0.02)
    pytest.fail(f"timed out waiting {what}")


def test_a_job_killed_mid_batch_resumes_from_its_checkpoint_with_identifiable_replays(
    spark_stream: StreamSpec, settings: Settings, tmp_path: Path
) -> None:
    # Given 16 000 keyed rows in 4 files, one file per micro-batch
    write_json_rows(tmp_path / "in", keyed_rows(ROWS, 500), FILES)
    checkpoint = tmp_path / "chk"
    metrics_port = free_port()
    args = [
        "--etcd-endpoints", settings.etcd_endpoints,
        "--amqp-url", settings.amqp.url,
        "spark-job",
        "--stream", spark_stream.name,
        "--source", str(tmp_path / "in"),
        "--format", "json",
        "--schema", ROW_SCHEMA,
        "--key-column", "key",
        "--order-column", "order",
        "--checkpoint", str(checkpoint),
        "--max-files-per-trigger", "1",
        "--trigger-seconds", "0",
        "--partitions", str(spark_stream.partitions),
        "--metrics-port", str(metrics_port),
        "--metrics-addr", "127.0.0.1",
        *[arg for key, value in SPARK_CONF.items() for arg in ("--spark-conf", f"{key}={value}")],
    ]  # fmt: skip
    log = tmp_path / "job.log"

    def depth() -> int:
        return sum(queue_depths(settings.amqp, spark_stream))

    # When the job is SIGKILLed while a batch is being published
    with _job(args, log) as first:
        _wait(lambda: depth() % ROWS_PER_FILE > 0, "for a batch in flight", 240, first)
        os.killpg(first.pid, signal.SIGKILL)
        _kill_session(first.pid)
    in_flight = depth() // ROWS_PER_FILE  # the batch that was being published
    assert 0 < depth() < ROWS
    assert committed_batches(checkpoint) == list(range(in_flight)), "a half batch was committed"

    # And restarted with the same checkpoint, then stopped with SIGTERM once all is committed
    with _job(args, log) as second:
        last_batch = f"batch {FILES - 1}: {ROWS_PER_FILE} rows published"
        _wait(lambda: last_batch in log.read_text(), "for the last batch", 240, second)
        assert committed_batches(checkpoint) == list(range(FILES))
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as response:
            exported = response.read().decode()
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0, log.read_text()[-3000:]
    output = log.read_text()
    assert "SIGTERM received, stopping the query" in output
    published = f'partq_spark_rows_published_total{{stream="{spark_stream.name}"}}'
    assert published in exported

    # Then no row is missing, and every extra copy is a replay of the killed batch:
    # same message id, same body, one query id across both runs
    queues = read_all(settings.amqp, spark_stream)
    delivered = [m for messages in queues.values() for m in messages]
    copies: dict[str, list[Delivered]] = defaultdict(list)
    for m in delivered:
        copies[m.message_id].append(m)
    assert sorted(m[0].row["order"] for m in copies.values()) == list(range(ROWS))
    replayed = {message_id: ms for message_id, ms in copies.items() if len(ms) > 1}
    assert replayed, "the killed batch published nothing before the kill"
    assert len(delivered) - len(copies) == sum(len(ms) - 1 for ms in replayed.values())
    for message_id, ms in replayed.items():
        assert {m.body for m in ms} == {ms[0].body}, f"{message_id}: a replay with another body"
        assert ReplayId.parse(message_id).batch_id == in_flight
    assert len({ReplayId.parse(m.message_id).query_id for m in delivered}) == 1
    # and, dropping replays, each key's rows are in order in their queue
    for messages in queues.values():
        seen: set[str] = set()
        last: dict[str, int] = {}
        for m in messages:
            if m.message_id in seen:
                continue
            seen.add(m.message_id)
            key, order = m.headers["partq-key"], m.row["order"]
            assert order > last.get(key, -1), f"{key} out of order"
            last[key] = order


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

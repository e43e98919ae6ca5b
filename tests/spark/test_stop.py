"""``partq spark-job`` stopped by SIGTERM at any point: exit 0, one line, no traceback."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from partq.producer.contract import StreamSpec

from partq.kernel.settings import Settings
from tests.spark.conftest import SPARK_CONF_ARGS, job_process, queue_depths, wait_for_job

pytestmark = [pytest.mark.spark, pytest.mark.fault, pytest.mark.slow]

STOP_TIMEOUT = 180.0  # Spark's start-up alone took over 40 s at a load average of 39


def rate_job_args(settings: Settings, spec: StreamSpec, checkpoint: Path) -> list[str]:
    return [
        "--etcd-endpoints", settings.etcd_endpoints, "--amqp-url", settings.amqp.url,
        "spark-job", "--stream", spec.name, "--rate", "20", "--trigger-seconds", "0.5",
        "--checkpoint", str(checkpoint), *SPARK_CONF_ARGS,
    ]  # fmt: skip


def assert_stopped_cleanly(returncode: int, output: str) -> None:
    assert returncode == 0, output[-3000:]
    assert "stopped on SIGTERM" in output, output[-3000:]
    assert "Traceback" not in output and "Py4J" not in output, output[-3000:]


@pytest.mark.timeout(900)  # two Spark start-ups: 100 s each at a load average of 40
def test_sigterm_during_start_up_and_while_running_stops_the_job_with_exit_0(
    spark_stream: StreamSpec, settings: Settings, tmp_path: Path
) -> None:
    log = tmp_path / "job.log"
    args = rate_job_args(settings, spark_stream, tmp_path / "chk")

    # Given a job still starting Spark / When it gets SIGTERM
    with job_process(args, log) as starting:
        wait_for_job(lambda: "starting Spark" in log.read_text(), "for start-up", 120, starting)
        starting.send_signal(signal.SIGTERM)
        # Then it stops Spark once it is up, exits 0, and says so in one line
        returncode = starting.wait(STOP_TIMEOUT)
    assert_stopped_cleanly(returncode, log.read_text())
    assert sum(queue_depths(settings.amqp, spark_stream)) == 0, "no query should have run"

    # Given a job publishing / When SIGTERM reaches its whole process group (the JVM too,
    # as from a supervisor that signals every process)
    log = tmp_path / "running.log"
    with job_process(args, log) as running:

        def publishing() -> bool:
            return sum(queue_depths(settings.amqp, spark_stream)) > 0

        wait_for_job(publishing, "for published messages", 240, running)
        os.killpg(running.pid, signal.SIGTERM)
        returncode = running.wait(STOP_TIMEOUT)
    # Then it exits 0 too, without a Python or Py4J traceback
    assert_stopped_cleanly(returncode, log.read_text())

"""README's ``spark-submit … partq/cli/spark.py`` command, run as written.

The block between ``<!-- spark-submit:begin -->`` and ``end`` (in README.md or a page
of docs/) is run by bash, unchanged, in a folder standing in for the checkout (its
``.venv`` and ``cli`` linked to this one's). The test sets only environment variables
(a private RabbitMQ virtual host in ``PARTQ_AMQP_URL``, Spark's settings folder) and
serves etcd where the command says, 127.0.0.1:2379, with a private etcd; it writes
rows to ``data/orders``, waits until every row is in the stream's queues, then stops
the job as a supervisor would: SIGTERM to the job's Python process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from partq.coordinator.ops import admin
from partq.producer.contract import StreamSpec
from partq.producer.registry import Registry

from partq.kernel.local import LocalEtcd
from partq.kernel.settings import Settings
from tests.cluster import kill_session, session_processes
from tests.spark.conftest import FAST_JVM, queue_depths, wait_for_job

pytestmark = [pytest.mark.spark, pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(
    r"<!-- spark-submit:begin -->\s*```sh\n(.*?)```\s*<!-- spark-submit:end -->", re.DOTALL
)
ROWS = 200


def readme_command() -> str:
    """The block's command: in README.md, or in the one page of docs/ it moved to."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    found = [m.group(1) for page in pages for m in BLOCK.finditer(page.read_text())]
    assert len(found) == 1, f"{len(found)} spark-submit blocks marked in README.md and docs/"
    return found[0]


@pytest.fixture
def etcd_2379() -> Iterator[str]:
    """A private etcd on the command's endpoint, 127.0.0.1:2379."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 2379)) == 0:
            message = "127.0.0.1:2379, README's etcd endpoint, is taken here"
            if os.environ.get("CI"):
                pytest.fail(message, pytrace=False)
            pytest.skip(message)
    with LocalEtcd(port=2379) as etcd:
        yield etcd.endpoint


def driver_pid(session: int) -> int | None:
    """The job's Python process (spark-submit's child running partq/cli/spark.py)."""
    for pid in session_processes(session):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            script = any(
                arg.endswith(b"partq/cli/spark.py") for arg in argv
            )  # spark-submit resolves it
            if Path(argv[0].decode()).name.startswith("python") and script:
                return pid
    return None


@pytest.mark.timeout(900)  # Spark's start-up took 100 s at a load average of 40
def test_the_readme_spark_submit_command_publishes_and_stops(
    etcd_2379: str, vhost: str, tmp_path: Path
) -> None:
    command = readme_command()
    assert "--stream orders" in command and "data/orders" in command, command
    # Given the stream `orders` on a private etcd and virtual host, and rows in data/orders
    registry = Registry.connect(Settings.load(etcd_endpoints=etcd_2379, amqp_url=vhost))
    spec = StreamSpec("orders", 4)
    admin.create_stream(registry, vhost, spec)
    checkout = tmp_path / "checkout"
    (checkout / "data" / "orders").mkdir(parents=True)
    for name in (".venv", "partq"):
        (checkout / name).symlink_to(ROOT / name)
    rows = [json.dumps({"user_id": f"user-{i % 20}", "n": i}) for i in range(ROWS)]
    (checkout / "data" / "orders" / "part-0.json").write_text("\n".join(rows) + "\n")
    conf = tmp_path / "spark-conf"  # few tasks, no UI port: a small run on a busy machine
    conf.mkdir()
    (conf / "spark-defaults.conf").write_text(
        "spark.sql.shuffle.partitions 4\nspark.ui.enabled false\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARTQ_")}
    env.update(FAST_JVM, PARTQ_AMQP_URL=vhost, SPARK_CONF_DIR=str(conf))
    log = tmp_path / "job.log"

    # When the command runs as written
    with log.open("ab") as out:
        job = subprocess.Popen(
            ["bash", "-c", command],
            cwd=checkout,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # Then every row is published to the stream's queues
        def published() -> bool:
            return sum(queue_depths(vhost, spec)) == ROWS

        wait_for_job(published, f"for {ROWS} rows in the queues", 300, job)
        # And a SIGTERM to the job stops it: exit 0, one line saying so, no traceback
        driver = driver_pid(job.pid)
        assert driver is not None, "no python process running partq/cli/spark.py"
        os.kill(driver, signal.SIGTERM)
        returncode = job.wait(180)
    finally:
        kill_session(job.pid)
        job.wait()
        with contextlib.suppress(Exception):
            admin.delete(registry, vhost, spec.name)
        registry.close()
    output = log.read_text()
    assert returncode == 0, output[-3000:]
    assert "stopped on SIGTERM" in output, output[-3000:]
    assert "Traceback" not in output and "Py4J" not in output, output[-3000:]

"""``consumers.run`` in an application's ``main``: exit codes and logs, not tracebacks.

Each test runs a small application in its own Python process against the private etcd
(connection settings in the environment, as an application would have them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from partq.kernel.settings import Settings

pytestmark = [pytest.mark.integration]

APPLICATION = """
import json, logging, sys
import partq

if sys.argv[3] == "own-logging":
    logging.basicConfig(stream=sys.stdout, format="app: %(levelname)s %(message)s")

def handle(message):
    pass

sys.exit(partq.run(sys.argv[1], handle, **json.loads(sys.argv[2])))
"""


def run_application(
    settings: Settings, stream: str, config: dict[str, object], logging: str = "none"
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PARTQ_ETCD_ENDPOINTS": settings.etcd_endpoints,
        "PARTQ_AMQP_URL": settings.amqp.url,
    }
    return subprocess.run(
        [sys.executable, "-c", APPLICATION, stream, json.dumps(config), logging],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_a_missing_stream_returns_1_with_one_log_line(settings: Settings, stream_name: str) -> None:
    # Given no stream of that name, and an application that configures no logging
    # When it calls consumers.run
    done = run_application(settings, stream_name, {})
    # Then run returns 1 (a runtime failure, as `partq consume`) after one logged line
    # (JSON off a terminal) saying how to create the stream, and no traceback
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    record = json.loads(lines[0])
    assert record["level"] == "ERROR"
    assert f"partq stream create {stream_name}" in record["message"]
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"weight": 0}, "weight must be 1 to 1000"),
        ({"max_attempts": 0}, "max attempts must be at least 1"),
        ({"prefetch": 70_000}, "prefetch must be between 1 and 65535"),
        ({"member_id": 'evil"x'}, "member id"),
    ],
)
def test_a_bad_config_value_returns_2_with_one_log_line(
    settings: Settings, stream_name: str, config: dict[str, object], named: str
) -> None:
    # Given a config value the consumer refuses
    # When an application passes it to consumers.run
    done = run_application(settings, stream_name, config)
    # Then run returns 2 (a usage error) after one log line naming the value
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert named in json.loads(lines[0])["message"]


def test_an_application_s_own_logging_is_kept(settings: Settings, stream_name: str) -> None:
    # Given an application that configured logging itself (basicConfig to stdout)
    # When consumers.run cannot start
    done = run_application(settings, stream_name, {"weight": 0}, logging="own-logging")
    # Then the error goes through the application's handler, and partq adds none
    assert done.returncode == 2, done.stderr
    expected = "app: ERROR weight must be 1 to 1000, got 0 (exit 2)"
    assert done.stdout.splitlines() == [expected], done.stdout
    assert done.stderr == ""

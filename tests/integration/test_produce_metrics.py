"""``partq produce --http-port``: a long-running producer serves its metrics to Prometheus
(the compose file's producer does, for the dashboard's producer panels)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from partq.coordinator.ops import admin
from partq.producer import StreamNotFound, StreamSpec
from partq.producer.registry import Registry
from prometheus_client.parser import text_string_to_metric_families

from partq.kernel.settings import Settings
from tests.integration.groups.harness import PARTQ
from tests.integration.test_quick_start import partq_env
from tests.polling import wait_until

pytestmark = [pytest.mark.integration]

URL = re.compile(r"producer metrics on (http://127\.0\.0\.1:\d+)/metrics")


@pytest.fixture
def stream(registry: Registry, settings: Settings, stream_name: str) -> Iterator[StreamSpec]:
    spec = StreamSpec(stream_name, 3, "quorum")
    admin.create_stream(registry, settings.amqp, spec)
    yield spec
    with contextlib.suppress(StreamNotFound):
        admin.delete(registry, settings.amqp, stream_name)


def samples(base: str, stream: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("partq_producer_") and sample.labels.get("stream") == stream
    }


def test_a_producer_reading_stdin_serves_its_metrics(
    settings: Settings, stream: StreamSpec, tmp_path: Path
) -> None:
    # Given `partq produce --from - --http-port 0`, reading a pipe that stays open
    log, summary = tmp_path / "produce.log", tmp_path / "produce.out"
    args = [str(PARTQ), "produce", stream.name, "--from", "-", "--http-port", "0"]
    with log.open("wb") as err, summary.open("wb") as out:
        popen = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=out, stderr=err, env=partq_env(settings)
        )
    try:
        assert popen.stdin is not None
        found = wait_until(lambda: URL.search(log.read_text()), 30, what="the metrics URL logged")
        base = found.group(1)
        # When it has published 25 lines
        for n in range(25):
            popen.stdin.write(json.dumps({"key": f"k{n % 5}", "body": str(n)}).encode() + b"\n")
        popen.stdin.flush()

        # Then /metrics shows them published and confirmed, while it still runs
        def confirmed() -> bool:
            assert popen.poll() is None, log.read_text()
            return samples(base, stream.name).get("partq_producer_confirmed_total") == 25

        wait_until(confirmed, 30, interval=0.2, what="25 confirmed in /metrics")
        seen = samples(base, stream.name)
        assert seen["partq_producer_published_total"] == 25
        assert seen["partq_producer_confirm_seconds_count"] == 25
        assert seen["partq_producer_in_flight_messages"] == 0
        with urllib.request.urlopen(f"{base}/readyz", timeout=5) as response:
            assert response.status == 200
        # And it ends as before when its input does
        popen.stdin.close()
        assert popen.wait(30) == 0, log.read_text()
        assert summary.read_text().startswith("sent 25, confirmed 25, failed 0")
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait(10)
        if popen.stdin is not None:
            popen.stdin.close()

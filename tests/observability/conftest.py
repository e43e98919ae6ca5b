"""Fixtures for the observability tests: partq daemons and Prometheus as OS processes.

Every process is started here with ``subprocess.Popen`` and ended by its own PID;
every stream is created for one test and deleted after it. Waiting is bounded
polling of what the test observes (HTTP endpoints, Prometheus' query API).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from partq.coordinator.ops import admin
from partq.producer import StreamSpec
from partq.producer.registry import Registry

from partq.kernel.local import LocalEtcd
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
PARTQ = ROOT / ".venv" / "bin" / "partq"
ARTIFACTS = ROOT / "artifacts"
HANDLER = "examples.handlers:noop_handler"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_answer(
    url: str,
    timeout: float = 5.0,
    *,
    token: str | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers), with ``Authorization: Bearer token`` and ``context`` for
    HTTPS if given; (0, b"", {}) when nothing answers (or TLS fails)."""
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)
    except (urllib.error.URLError, OSError):
        return 0, b"", {}


def http_get(url: str, timeout: float = 5.0, **options: Any) -> tuple[int, bytes]:
    """(status, body); (0, b"") when nothing answers. ``options``: :func:`http_answer`'s."""
    status, body, _ = http_answer(url, timeout, **options)
    return status, body


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    port: int
    scheme: str = "http"

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def base(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self, timeout: float = 15.0) -> int | None:
        """SIGTERM by PID and wait; SIGKILL if it does not exit in time."""
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(10)
            return None

    def tail(self, lines: int = 25) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _scheme(flags: tuple[str, ...]) -> str:
    return "https" if "--http-cert" in flags else "http"


@dataclass
class Launcher:
    """This test's processes; ``close()`` ends those still running, each by its PID."""

    tmp: Path
    etcd: str
    amqp: str
    procs: list[Proc] = field(default_factory=list)

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"PARTQ_ETCD_ENDPOINTS": self.etcd, "PARTQ_AMQP_URL": self.amqp})
        env.update(extra or {})
        return env

    def start(
        self,
        name: str,
        argv: list[str],
        port: int,
        *,
        env: dict[str, str] | None = None,
        scheme: str = "http",
    ) -> Proc:
        """Start ``argv`` with this test's etcd and RabbitMQ in its environment (and ``env``);
        stdout and stderr go to one log file."""
        log = self.tmp / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                env=self._env(env),
                cwd=ROOT,
            )
        proc = Proc(name, popen, log, port, scheme)
        self.procs.append(proc)
        return proc

    def coordinator(self, stream: str, *flags: str, env: dict[str, str] | None = None) -> Proc:
        port = free_port()
        argv = [str(PARTQ), "coordinator", stream, "--settle", "0.3", "--ttl", "2"]
        argv += ["--http-host", "127.0.0.1", "--http-port", str(port), *flags]
        return self.start("coordinator", argv, port, env=env, scheme=_scheme(flags))

    def consumer(
        self,
        stream: str,
        member: str,
        port: int | None = None,
        *flags: str,
        env: dict[str, str] | None = None,
    ) -> Proc:
        port = port or free_port()
        argv = [str(PARTQ), "consume", stream, "--handler", HANDLER, "--member-id", member]
        argv += ["--ttl", "2", "--drain-timeout", "5"]
        argv += ["--http-host", "127.0.0.1", "--http-port", str(port), *flags]
        return self.start(member, argv, port, env=env, scheme=_scheme(flags))

    def wait_ready(
        self, proc: Proc, timeout: float = 30.0, path: str = "/readyz", **options: Any
    ) -> None:
        """Until ``proc`` answers 200 on ``path`` (``options``: :func:`http_answer`'s)."""

        def ready() -> bool:
            if not proc.alive():
                code = proc.popen.returncode
                raise AssertionError(f"{proc.name} exited ({code}):\n{proc.tail()}")
            return http_get(proc.base + path, timeout=2, **options)[0] == 200

        wait_until(ready, timeout, what=f"{proc.name} {path}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.alive():
                proc.terminate(timeout=10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} (pid {p.pid}) ---\n{p.tail()}" for p in self.procs)


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def make_stream(
    registry: Registry, rabbitmq: str, stream_name: str
) -> Iterator[Callable[[int], StreamSpec]]:
    """``make_stream(P)`` creates this test's stream; it is deleted after the test."""
    created: list[StreamSpec] = []

    def make(partitions: int) -> StreamSpec:
        spec = StreamSpec(stream_name, partitions, "quorum")
        admin.create_stream(registry, rabbitmq, spec)
        created.append(spec)
        return spec

    yield make
    for spec in created:
        admin.delete(registry, rabbitmq, spec.name)


@pytest.fixture
def launcher(
    tmp_path: Path, etcd_server: LocalEtcd, rabbitmq: str, make_stream: Any
) -> Iterator[Launcher]:
    """Requests ``make_stream`` so the processes end before the stream is deleted."""
    fleet = Launcher(tmp_path, etcd_server.endpoint, rabbitmq)
    try:
        yield fleet
    finally:
        fleet.close()


# -- Prometheus --------------------------------------------------------------------------


@dataclass
class Prometheus:
    proc: Proc

    @property
    def base(self) -> str:
        return self.proc.base

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """An instant query's vector result as (labels, value) pairs."""
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        status, body = http_get(url)
        if status != 200:
            raise AssertionError(f"query {promql!r}: HTTP {status} {body[:300]!r}")
        answer = json.loads(body)
        assert answer["status"] == "success", answer
        result = answer["data"]["result"]
        if answer["data"]["resultType"] == "scalar":
            return [({}, float(result[1]))]
        return [(r["metric"], float(r["value"][1])) for r in result]

    def scalar(self, promql: str) -> float | None:
        """The single value of a query, or None when the vector is empty."""
        result = self.query(promql)
        assert len(result) <= 1, f"{promql!r} gave {len(result)} series: {result}"
        return result[0][1] if result else None


PROMETHEUS = Path("/usr/bin/prometheus")


@pytest.fixture
def start_prometheus(
    tmp_path: Path, launcher: Launcher
) -> Callable[[dict[str, list[str]]], Prometheus]:
    """``start_prometheus({job: ["127.0.0.1:port", ...]})``: scrape every 1 s, return when ready."""
    if not PROMETHEUS.exists():
        if os.environ.get("CI"):
            pytest.fail("/usr/bin/prometheus is required in CI", pytrace=False)
        pytest.skip("/usr/bin/prometheus is not installed")

    def start(jobs: dict[str, list[str]]) -> Prometheus:
        home = tmp_path / "prometheus"
        home.mkdir()
        lines = ["global:", "  scrape_interval: 1s", "  scrape_timeout: 1s", "scrape_configs:"]
        for job, targets in jobs.items():
            listed = json.dumps(targets)  # a YAML flow sequence
            lines += [f"  - job_name: {job}", "    static_configs:", f"      - targets: {listed}"]
        config = home / "prometheus.yml"
        config.write_text("\n".join(lines) + "\n")
        port = free_port()
        argv = [
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        proc = launcher.start("prometheus", argv, port)
        launcher.wait_ready(proc, timeout=30, path="/-/ready")
        return Prometheus(proc)

    return start

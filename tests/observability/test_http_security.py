"""The daemons' HTTP port with TLS and a bearer token: real ``partq coordinator`` and
``partq consume`` processes on real etcd and RabbitMQ, certificates from tests/pki.py.

What is checked: HTTPS verified against the test CA (and refused without it); 401
without or with a wrong token, 200 with it; the probes and /metrics open; the token from
a file or the environment; and the token appears nowhere a person or another user could
read it: the process's stdout and stderr, its argv (``/proc/PID/cmdline``, what ``ps``
shows), /metrics, the page, the 401 answers.
"""

from __future__ import annotations

import secrets
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.pki import issue, make_ca

from .conftest import PARTQ, ROOT, Launcher, Proc, http_answer, http_get

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 signed by it, and a CA that did not sign it."""
    directory = tmp_path_factory.mktemp("http-pki")
    ca, _ = make_ca(directory, "ca")
    other, _ = make_ca(directory, "other")
    cert, key = issue(directory, "ca", "http", "partq-http", "IP:127.0.0.1,DNS:localhost")
    return {"ca": ca, "other": other, "cert": cert, "key": key}


def verifying(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def token_file(tmp_path: Path, token: str) -> Path:
    path = tmp_path / "http-token"
    path.write_text(token + "\n")  # as a mounted Kubernetes Secret gives it
    path.chmod(0o400)
    return path


def assert_nowhere(token: str, proc: Proc, *answers: bytes) -> None:
    """The token is not in the process's output, its argv, or any answer it gave."""
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    assert token.encode() not in cmdline, "the token is in argv (ps shows it)"
    log = proc.log.read_text(errors="replace")
    assert token not in log, "the token is in the process's stdout or stderr"
    for answer in answers:
        assert token.encode() not in answer


def test_coordinator_serves_https_and_guards_its_page_with_the_token_file(
    launcher: Launcher, make_stream: Any, certs: dict[str, Path], tmp_path: Path
) -> None:
    # Given a coordinator serving HTTPS with the test certificate, its token from a file
    spec = make_stream(2)
    token = secrets.token_urlsafe(24)
    flags = ("--http-cert", str(certs["cert"]), "--http-key", str(certs["key"]))
    coordinator = launcher.coordinator(
        spec.name, *flags, env={"PARTQ_HTTP_TOKEN_FILE": str(token_file(tmp_path, token))}
    )
    tls = verifying(certs["ca"])
    launcher.wait_ready(coordinator, context=tls)
    assert coordinator.base.startswith("https://")

    # When the page is asked for without the token, or with a wrong one
    answers: list[bytes] = []
    for wrong in (None, "wrong", token[:-1], token + "x"):
        status, body, headers = http_answer(coordinator.base + "/", context=tls, token=wrong)
        answers.append(body)
        # Then 401, a Bearer challenge and one line
        assert status == 401, (wrong, status, body)
        assert headers.get("WWW-Authenticate", "").startswith("Bearer"), headers
        assert body.decode().count("\n") == 1, body
        assert spec.queue(0).encode() not in body  # no group detail leaks
    # And with the token the page names the stream's queues
    status, page, _ = http_answer(coordinator.base + "/", context=tls, token=token)
    assert status == 200, page
    assert spec.queue(1).encode() in page
    # And the probes and /metrics answer without it
    for path in ("/livez", "/readyz", "/metrics"):
        assert http_get(coordinator.base + path, context=tls)[0] == 200, path
    metrics = http_get(coordinator.base + "/metrics", context=tls)[1]
    assert b"partq_coordinator_is_leader" in metrics

    # And TLS is verified: a client trusting another CA, or speaking plain HTTP, gets nothing
    assert http_get(coordinator.base + "/livez", context=verifying(certs["other"]))[0] == 0
    assert http_get(f"http://127.0.0.1:{coordinator.port}/livez")[0] == 0
    # (the server survives those and still answers)
    assert http_get(coordinator.base + "/livez", context=tls)[0] == 200

    # And the token is nowhere to be read
    assert coordinator.alive()
    assert_nowhere(token, coordinator, page, metrics, *answers)
    log = coordinator.log.read_text()
    assert "status page on https://127.0.0.1:" in log and "(bearer token required)" in log
    assert "Traceback" not in log


def test_consumer_token_from_the_environment_can_guard_metrics_too(
    launcher: Launcher, make_stream: Any
) -> None:
    # Given a consumer with its token in PARTQ_HTTP_TOKEN and --http-token-metrics
    spec = make_stream(2)
    token = secrets.token_urlsafe(24)
    consumer = launcher.consumer(
        spec.name, "member-a", None, "--http-token-metrics", env={"PARTQ_HTTP_TOKEN": token}
    )
    launcher.wait_ready(consumer)
    # Then the probes are open, /metrics needs the token, and anything else too
    assert http_get(consumer.base + "/livez")[0] == 200
    denied = http_answer(consumer.base + "/metrics")
    assert denied[0] == 401 and denied[2].get("WWW-Authenticate", "").startswith("Bearer")
    assert http_get(consumer.base + "/", token="nope")[0] == 401
    status, metrics = http_get(consumer.base + "/metrics", token=token)
    assert status == 200 and b"partq_consumer" in metrics
    assert http_get(consumer.base + "/", token=token)[0] == 404  # a consumer has no page
    assert_nowhere(token, consumer, metrics, denied[1])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--http-cert", "{missing}", "--http-key", "{missing}"), "cannot serve HTTPS"),
        (("--http-cert", "{cert}", "--http-key", "{other_key}"), "cannot serve HTTPS"),
        (("--http-cert", "{cert}"), "set both --http-cert and --http-key"),
    ],
)
def test_unusable_certificates_are_one_line_and_exit_2(
    launcher: Launcher,
    make_stream: Any,
    certs: dict[str, Path],
    tmp_path: Path,
    flags: tuple[str, ...],
    expected: str,
) -> None:
    # Given a coordinator started with a certificate it cannot use
    spec = make_stream(1)
    paths = {
        "missing": tmp_path / "missing.pem",
        "cert": certs["cert"],
        "other_key": certs["other"].with_suffix(".key"),
    }
    argv = [str(PARTQ), "coordinator", spec.name, "--http-port", "0"]
    argv += [flag.format(**paths) for flag in flags]
    env = launcher._env({"PARTQ_HTTP_TOKEN": "t0ken-not-to-print"})
    # When it starts, Then it exits 2 with one line saying which files, and no token
    done = subprocess.run(
        argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60, check=False
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], done.stderr
    assert "t0ken-not-to-print" not in done.stdout + done.stderr

"""partq.cli.web: what a method other than GET, a malformed request and a burst of connections
get. The token is checked first; no answer names partq's or Python's version."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from pydantic import SecretStr

from partq.cli.web import _Server
from partq.kernel.settings import HttpSecurity

TOKEN = "s3cret-Token-9f2"


def _request(
    base: str, method: str, path: str, token: str | None = None
) -> tuple[int, bytes, dict[str, str]]:
    parts = urlsplit(base)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5)
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        connection.request(method, path, headers=headers)
        response = connection.getresponse()
        body = response.read() if method != "HEAD" else b""
        return response.status, body, dict(response.headers)
    finally:
        connection.close()


def test_a_method_other_than_get_is_a_bare_405_after_the_token(
    server: Callable[..., str],
) -> None:
    # Given a server with a token and a status page
    base = server(page=lambda: "<html>page</html>", security=HttpSecurity(token=SecretStr(TOKEN)))
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "HEAD", "FOO"):
        # When a guarded path is asked with another method and no token
        status, body, headers = _request(base, method, "/")
        # Then the token is checked first: 401, as for a GET
        assert status == 401, method
        # And with the token (or on an open probe) the answer is a 405 with no body
        for path, token in (("/", TOKEN), ("/livez", None), ("/metrics", None)):
            status, body, headers = _request(base, method, path, token)
            assert (status, body) == (405, b""), (method, path, body)
            assert headers["Allow"] == "GET"
            assert headers["Content-Length"] == "0"
            assert "Server" not in headers, headers


def test_no_answer_names_a_version(server: Callable[..., str]) -> None:
    # Given a server without a token
    base = server()
    # When a GET, a 404 and a request with too many headers are sent
    answers = [_request(base, "GET", "/livez"), _request(base, "GET", "/nothing")]
    parts = urlsplit(base)
    with socket.create_connection((parts.hostname or "", parts.port or 0), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n")  # too many headers
        data = b""
        while chunk := s.recv(65536):  # the server closes the connection after it
            data += chunk
        raw = data.decode("latin-1")
    # Then none has a Server header, and the refused request is one plain line
    for status, _body, headers in answers:
        assert "Server" not in headers, (status, headers)
    assert raw.startswith("HTTP/1.0 431"), raw
    assert "Server:" not in raw and "Python" not in raw and "<html" not in raw.lower(), raw
    assert raw.endswith("\r\n\r\nrequest header fields too large\n"), raw


def test_the_listen_backlog_fits_a_scrape_burst() -> None:
    # socketserver's default of 5 left clients of a burst waiting on SYN retransmits
    assert _Server.request_queue_size >= 128


BURST = 500
BOUND_S = 10.0  # each answer, at most (a SYN retransmit alone would add 1 s, then 3 s…)


def test_a_burst_of_500_connections_is_answered_within_a_bound(
    server: Callable[..., str],
) -> None:
    # Given a server
    base = server()
    parts = urlsplit(base)
    address = (parts.hostname or "", parts.port or 0)
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    go = threading.Event()

    def probe() -> None:
        go.wait(10)
        started = time.monotonic()
        try:
            with socket.create_connection(address, timeout=BOUND_S * 3) as s:
                s.sendall(b"GET /livez HTTP/1.0\r\n\r\n")
                data = b""
                while chunk := s.recv(4096):
                    data += chunk
            ok = data.startswith(b"HTTP/1.0 200")
        except OSError as e:
            ok, data = False, repr(e).encode()
        with lock:
            latencies.append(time.monotonic() - started)
            if not ok:
                failures.append(data[:80].decode("latin-1"))

    # When 500 clients connect to /livez at once
    threads = [threading.Thread(target=probe) for _ in range(BURST)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(BOUND_S * 4)
    # Then every one is answered 200, each within the bound
    assert not failures, failures[:5]
    assert len(latencies) == BURST
    latencies.sort()
    slowest = latencies[-1]
    assert slowest < BOUND_S, f"p50 {latencies[BURST // 2]:.3f}s, slowest {slowest:.3f}s"

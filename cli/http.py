"""``/livez``, ``/readyz`` and ``/metrics`` on one port (and an optional page at ``/``).

A failure behind an endpoint is an answer, never a traceback: a :class:`PartqError`
(etcd or RabbitMQ unreachable…) from ``ready`` or ``page`` is a 503 whose body is one
line with the reason; anything else a 500 with one line. Each is logged at warning once
when the endpoint starts failing (and at info when it works again), not per request.
A failure while preparing ``/metrics`` (``before_metrics``) is logged the same way and
the metrics are served anyway: they are this process's own.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import click
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from kernel.errors import PartqError, UsageError

__all__ = ["bind_error", "http_options", "serve", "serve_http"]

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("partq.http")
_PLAIN = "text/plain; charset=utf-8"


class _Failures:
    """Per endpoint, the reason it currently fails; logs transitions only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failing: dict[str, str] = {}

    def failed(self, path: str, reason: str, error: BaseException) -> None:
        with self._lock:
            first = path not in self._failing
            self._failing[path] = reason
        if first:
            unexpected = not isinstance(error, PartqError)
            log.warning("GET %s failing: %s", path, reason, exc_info=unexpected)

    def ok(self, path: str) -> None:
        with self._lock:
            was = self._failing.pop(path, None)
        if was is not None:
            log.info("GET %s works again", path)


def _one_line(error: BaseException) -> str:
    text = str(error) if isinstance(error, PartqError) else f"{type(error).__name__}: {error}"
    return " ".join(text.split()) or type(error).__name__


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer is not worth a traceback on stderr."""
        log.debug("HTTP client %s: connection error", client_address, exc_info=True)


def serve(
    host: str,
    port: int,
    *,
    live: Callable[[], bool],
    ready: Callable[[], bool],
    page: Callable[[], str] | None = None,
    before_metrics: Callable[[], None] | None = None,
) -> ThreadingHTTPServer:
    """Serve in a daemon thread; returns the server (``server.server_port``, ``shutdown()``).

    Binding happens here: ``OSError`` (port in use…) is raised to the caller.
    """
    failures = _Failures()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            try:
                code, body, ctype = self._answer(path)
            except Exception as e:
                reason = _one_line(e)
                failures.failed(path, reason, e)
                code = 503 if isinstance(e, PartqError) else 500
                prefix = "unavailable" if code == 503 else "internal error"
                self._send(code, f"{prefix}: {reason}\n".encode(), refresh=path == "/")
                return
            failures.ok(path)
            self._send(code, body, ctype)

        def _answer(self, path: str) -> tuple[int, bytes, str]:
            if path == "/metrics":
                if before_metrics is not None:
                    try:
                        before_metrics()
                    except Exception as e:
                        failures.failed("/metrics (before)", _one_line(e), e)
                    else:
                        failures.ok("/metrics (before)")
                return 200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST
            if path == "/livez":
                ok = live()
                return (200, b"ok\n", _PLAIN) if ok else (503, b"dead\n", _PLAIN)
            if path == "/readyz":
                ok = ready()
                return (200, b"ready\n", _PLAIN) if ok else (503, b"not ready\n", _PLAIN)
            if path == "/" and page is not None:
                return 200, page().encode(), "text/html; charset=utf-8"
            return 404, b"not found\n", _PLAIN

        def _send(
            self, code: int, body: bytes, ctype: str = _PLAIN, *, refresh: bool = False
        ) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            if refresh:  # the status page's error keeps reloading, like the page itself
                self.send_header("Refresh", "2")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = _Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server


def http_options(default_port: int) -> Callable[[F], F]:
    """``--http-host`` and ``--http-port`` for a daemon's /metrics, /livez, /readyz."""

    def decorate(command: F) -> F:
        command = click.option(
            "--http-port",
            type=click.IntRange(0, 65535),
            default=default_port,
            show_default=True,
            help="0: pick a free port (the chosen one is logged).",
        )(command)
        return click.option(
            "--http-host",
            default="127.0.0.1",
            show_default=True,
            envvar="PARTQ_HTTP_HOST",
            help="Address for /metrics, /livez, /readyz (0.0.0.0 in containers) [PARTQ_HTTP_HOST].",
        )(command)

    return decorate


def serve_http(host: str, port: int, **endpoints: Any) -> ThreadingHTTPServer:
    """:func:`cli.http.serve`, with a bind failure as one line naming the flag to change
    (a :class:`UsageError`: exit code 2)."""
    try:
        return serve(host, port, **endpoints)
    except OSError as e:
        raise UsageError(bind_error(host, port, e)) from None


def bind_error(host: str, port: int, error: OSError) -> str:
    where = f"{host}:{port}"
    other_port = "choose another port with --http-port, or --http-port 0 for any free port"
    if error.errno == errno.EADDRINUSE:
        return f"{where} is already in use (another partq daemon on this host?): {other_port}"
    if error.errno == errno.EACCES:
        return f"cannot listen on {where}: permission denied: {other_port}"
    reason = error.strerror or str(error)
    if isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {where}: {reason}: check --http-host"
    return f"cannot listen on {where}: {reason}: check --http-host and --http-port"

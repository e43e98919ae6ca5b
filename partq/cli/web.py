"""``/livez``, ``/readyz`` and ``/metrics`` on one port (and an optional page at ``/``).

Optionally over TLS (``--http-cert``/``--http-key``) and behind a bearer token
(``PARTQ_HTTP_TOKEN`` or ``PARTQ_HTTP_TOKEN_FILE``). With a token, every path but
``/livez``, ``/readyz`` and ``/metrics`` needs ``Authorization: Bearer <token>``
(the status page, and anything not found: nothing is revealed without it); the
probes stay open for the kubelet, and ``/metrics`` for Prometheus unless
``--http-token-metrics``. Otherwise 401 with ``WWW-Authenticate: Bearer``.

A failure behind an endpoint is an answer, never a traceback: a :class:`PartqError`
(etcd or RabbitMQ unreachable…) from ``ready`` or ``page`` is a 503 whose body is one
line with the reason; anything else a 500 with one line. Each is logged at warning once
when the endpoint starts failing (and at info when it works again), not per request.
A failure while preparing ``/metrics`` (``before_metrics``) is logged the same way and
the metrics are served anyway: they are this process's own.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import click
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from partq.cli.context import Context
from partq.kernel.errors import PartqError, UsageError
from partq.kernel.settings import HttpSecurity

__all__ = [
    "LOOPBACK",
    "base_url",
    "bind_error",
    "exposure_warning",
    "http_options",
    "serve",
    "serve_http",
    "server_context",
]

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("partq.http")
LOOPBACK = "127.0.0.1"  # every port partq serves, unless told otherwise (docs/security.md)
_PLAIN = "text/plain; charset=utf-8"
_OPEN = HttpSecurity()  # plain HTTP, no token
_PROBES = ("/livez", "/readyz")  # open whatever the token: the kubelet sends none
_UNAUTHORIZED = b"unauthorized: send the header Authorization: Bearer <PARTQ_HTTP_TOKEN>\n"


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


def _authorized(header: str | None, token: str) -> bool:
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def server_context(security: HttpSecurity) -> ssl.SSLContext | None:
    """The TLS context for ``security``'s certificate and key; a :class:`UsageError` (one
    line naming the files) when they cannot be used."""
    if security.cert is None or security.key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(security.cert, security.key)
    except (OSError, ssl.SSLError) as e:
        reason = getattr(e, "strerror", None) or getattr(e, "reason", None) or str(e)
        raise UsageError(
            f"cannot serve HTTPS with --http-cert {security.cert} and --http-key "
            f"{security.key}: {reason}: give a PEM certificate and the private key that "
            "matches it (PARTQ_HTTP_CERT, PARTQ_HTTP_KEY)"
        ) from None
    return context


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, or "" (every address)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # The listen backlog (the kernel caps it at net.core.somaxconn). socketserver's 5 made
    # clients of a scrape burst wait for SYN retransmits: seconds, past a minute for some.
    request_queue_size = 1024
    site: _Site  # set before it serves

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer is not worth a traceback on stderr."""
        log.debug("HTTP client %s: connection error", client_address, exc_info=True)


@dataclass(frozen=True)
class _Site:
    """What a server answers with: the probes, the status page, the token it wants."""

    live: Callable[[], bool]
    ready: Callable[[], bool]
    page: Callable[[], str] | None
    before_metrics: Callable[[], None] | None
    token: str | None
    open_paths: tuple[str, ...]  # answered without the token
    failures: _Failures

    def before_scrape(self) -> None:
        """Run ``before_metrics``; its failure is logged, and the scrape goes on."""
        if self.before_metrics is None:
            return
        try:
            self.before_metrics()
        except Exception as e:
            self.failures.failed("/metrics (before)", _one_line(e), e)
        else:
            self.failures.ok("/metrics (before)")


class _Handler(BaseHTTPRequestHandler):
    """Answers from its server's :class:`_Site`."""

    timeout = 30  # seconds a client may stall (a TLS handshake, a request line)

    def __getattr__(self, name: str) -> Any:
        """``do_POST``, ``do_FOO``…: every method but GET gets :meth:`_not_get` (the
        base class answers one it has no ``do_`` for with a 501 page of its own)."""
        if name.startswith("do_"):
            return self._not_get
        raise AttributeError(name)

    @property
    def site(self) -> _Site:
        server = self.server
        assert isinstance(server, _Server)
        return server.site

    def _denied(self, path: str) -> bool:
        """Whether the request lacks the token ``path`` needs (then it was answered)."""
        token = self.site.token
        guarded = token is not None and path not in self.site.open_paths
        if guarded and not _authorized(self.headers.get("Authorization"), token or ""):
            self._send(401, _UNAUTHORIZED, challenge=True)
            return True
        return False

    def _not_get(self) -> None:
        if not self._denied(self.path.split("?", 1)[0]):
            self._send(405, b"", allow="GET")

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if self._denied(path):
            return
        try:
            code, body, ctype = self._answer(path)
        except Exception as e:
            reason = _one_line(e)
            self.site.failures.failed(path, reason, e)
            code = 503 if isinstance(e, PartqError) else 500
            prefix = "unavailable" if code == 503 else "internal error"
            self._send(code, f"{prefix}: {reason}\n".encode(), refresh=path == "/")
            return
        self.site.failures.ok(path)
        self._send(code, body, ctype)

    def _answer(self, path: str) -> tuple[int, bytes, str]:
        site = self.site
        if path == "/metrics":
            site.before_scrape()
            return 200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST
        if path == "/livez":
            ok = site.live()
            return (200, b"ok\n", _PLAIN) if ok else (503, b"dead\n", _PLAIN)
        if path == "/readyz":
            ok = site.ready()
            return (200, b"ready\n", _PLAIN) if ok else (503, b"not ready\n", _PLAIN)
        if path == "/" and site.page is not None:
            return 200, site.page().encode(), "text/html; charset=utf-8"
        return 404, b"not found\n", _PLAIN

    def _send(
        self,
        code: int,
        body: bytes,
        ctype: str = _PLAIN,
        *,
        refresh: bool = False,
        challenge: bool = False,
        allow: str | None = None,
    ) -> None:
        self.send_response(code)
        if allow is not None:
            self.send_header("Allow", allow)
        if challenge:
            self.send_header("WWW-Authenticate", 'Bearer realm="partq"')
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if refresh:  # the status page's error keeps reloading, like the page itself
            self.send_header("Refresh", "2")
        self.end_headers()
        self.wfile.write(body)

    def send_response(self, code: int, message: str | None = None) -> None:
        """The status line and a Date: no ``Server`` header naming Python's version."""
        self.log_request(code)
        self.send_response_only(code, message)
        self.send_header("Date", self.date_time_string())

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """A request the base class cannot parse (bad request line, header too long…):
        the code and one plain line, not its HTML page."""
        self.close_connection = True
        reason = self.responses.get(code, ("error",))[0].lower()
        self._send(code, f"{reason}\n".encode())

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(
    host: str,
    port: int,
    *,
    live: Callable[[], bool],
    ready: Callable[[], bool],
    page: Callable[[], str] | None = None,
    before_metrics: Callable[[], None] | None = None,
    security: HttpSecurity = _OPEN,
) -> ThreadingHTTPServer:
    """Serve in a daemon thread; returns the server (``server.server_port``, ``shutdown()``).

    Binding happens here: ``OSError`` (port in use…) is raised to the caller, a
    certificate that cannot be used a :class:`UsageError`.
    """
    site = _Site(
        live,
        ready,
        page,
        before_metrics,
        security.token.get_secret_value() if security.token is not None else None,
        _PROBES if security.token_metrics else (*_PROBES, "/metrics"),
        _Failures(),
    )
    context = server_context(security)
    server = _Server((host, port), _Handler)
    server.site = site
    if context is not None:  # the handshake runs in the request's thread, not in accept()
        server.socket = context.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server


def _to_settings(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """A flag that is a setting: into the overrides the settings are built from (flag > env
    > file), as the ``partq`` group's own flags are."""
    if value and param.name is not None:  # an unset flag is False: the environment decides
        ctx.find_object(Context).overrides[param.name] = value  # type: ignore[union-attr]


def http_options(default_port: int | None) -> Callable[[F], F]:
    """``--http-host``, ``--http-port``, and the TLS and token settings of the daemon's port
    (``default_port`` None: no port unless ``--http-port`` is given)."""

    def decorate(command: F) -> F:
        settings = [
            click.option(
                "--http-token-metrics",
                is_flag=True,
                default=None,
                expose_value=False,
                callback=_to_settings,
                help="/metrics needs the token too (Prometheus then sends it) "
                "[PARTQ_HTTP_TOKEN_METRICS].",
            ),
            click.option(
                "--http-key",
                type=click.Path(path_type=Path),
                expose_value=False,
                callback=_to_settings,
                help="Private key of --http-cert [PARTQ_HTTP_KEY].",
            ),
            click.option(
                "--http-cert",
                type=click.Path(path_type=Path),
                expose_value=False,
                callback=_to_settings,
                help="Serve HTTPS with this PEM certificate (chain) [PARTQ_HTTP_CERT]. "
                "The bearer token for the status page has no flag: PARTQ_HTTP_TOKEN or "
                "PARTQ_HTTP_TOKEN_FILE.",
            ),
        ]
        for option in settings:
            command = option(command)
        command = click.option(
            "--http-port",
            type=click.IntRange(0, 65535),
            default=default_port,
            show_default=default_port is not None,
            # a daemon's port may come from its environment; a command that serves none
            # unless asked (produce) must not start serving because a daemon's is set
            envvar="PARTQ_HTTP_PORT" if default_port is not None else None,
            help="0: pick a free port (the chosen one is logged)."
            + (" Default: serve no port." if default_port is None else " [PARTQ_HTTP_PORT]"),
        )(command)
        return click.option(
            "--http-host",
            default=LOOPBACK,
            show_default=True,
            envvar="PARTQ_HTTP_HOST",
            help="Address for /metrics, /livez, /readyz (0.0.0.0 in containers) [PARTQ_HTTP_HOST].",
        )(command)

    return decorate


def serve_http(
    host: str, port: int, security: HttpSecurity, **endpoints: Any
) -> ThreadingHTTPServer:
    """:func:`partq.cli.web.serve`, with a bind failure as one line naming the flag to change
    (a :class:`UsageError`: exit code 2); warns once when the port is open beyond this host
    without a token (or sends the token without TLS)."""
    try:
        server = serve(host, port, security=security, **endpoints)
    except OSError as e:
        raise UsageError(bind_error(host, port, e)) from None
    warning = exposure_warning(host, security)
    if warning is not None:
        log.warning("HTTP on %s:%d %s", host, server.server_port, warning)
    return server


def exposure_warning(host: str, security: HttpSecurity) -> str | None:
    """What is wrong with serving on ``host`` this way, or None: a port reachable from
    other hosts needs the token, and the token needs TLS there."""
    if is_loopback(host):
        return None
    if security.token is None:
        return (
            "is reachable from other hosts and has no token: anyone who reaches it reads "
            "the status page; set PARTQ_HTTP_TOKEN_FILE (or PARTQ_HTTP_TOKEN), or bind 127.0.0.1"
        )
    if not security.tls:
        return (
            "takes the token over plain HTTP: it crosses the network in clear; "
            "serve HTTPS with --http-cert and --http-key"
        )
    return None


def base_url(host: str, server: ThreadingHTTPServer, security: HttpSecurity) -> str:
    """``http(s)://host:port`` of a started server, for log lines."""
    scheme = "https" if security.tls else "http"
    return f"{scheme}://{host}:{server.server_port}"


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

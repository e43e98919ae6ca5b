"""``/livez``, ``/readyz`` and ``/metrics`` on one port (and an optional page at ``/``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

__all__ = ["serve"]


def serve(
    host: str,
    port: int,
    *,
    live: Callable[[], bool],
    ready: Callable[[], bool],
    page: Callable[[], str] | None = None,
    before_metrics: Callable[[], None] | None = None,
) -> ThreadingHTTPServer:
    """Serve in a daemon thread; returns the server (``server.server_port``, ``shutdown()``)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                if before_metrics is not None:
                    before_metrics()
                self._send(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
            elif path == "/livez":
                ok = live()
                self._send(200 if ok else 503, b"ok\n" if ok else b"dead\n")
            elif path == "/readyz":
                ok = ready()
                self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
            elif path == "/" and page is not None:
                self._send(200, page().encode(), "text/html; charset=utf-8")
            else:
                self._send(404, b"not found\n")

        def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server

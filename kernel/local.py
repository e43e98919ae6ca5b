"""A private etcd server on loopback, for the demo, tests and benchmarks.

Starts Debian's ``etcd`` binary on free ports with its own data directory and
stops exactly the process it started.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kernel.errors import PartqError

__all__ = ["LocalEtcd", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class LocalEtcd:
    """``with LocalEtcd() as etcd: etcd.endpoint`` — a throwaway single-node etcd."""

    data_dir: Path | None = None
    port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> LocalEtcd:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        if not Path(binary).exists():
            raise PartqError("etcd is not installed: apt-get install etcd-server")
        if self.data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="partq-etcd-")
            self.data_dir = Path(self._tmp.name)
        log = open(self.data_dir / "etcd.log", "ab")  # noqa: SIM115 - lives as long as etcd
        self.process = subprocess.Popen(
            [
                binary,
                "--name", "partq-test",
                "--data-dir", str(self.data_dir / "data"),
                "--listen-client-urls", self.endpoint,
                "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-cluster", f"partq-test=http://127.0.0.1:{self.peer_port}",
                "--log-level", "warn",
            ],
            stdout=log,
            stderr=log,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PartqError(f"etcd exited at start; see {self.data_dir / 'etcd.log'}")
            if _answers(self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise PartqError(f"etcd did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.data_dir = None

    def restart(self, timeout: float = 15.0) -> None:
        """Stop the process and start it again on the same ports and data."""
        assert self.process is not None
        self.process.terminate()
        self.process.wait(10)
        self.start(timeout)

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

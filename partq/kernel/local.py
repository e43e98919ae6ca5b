"""A private etcd server on loopback, for the demo, tests and benchmarks.

Starts Debian's ``etcd`` binary on free ports with its own data directory and
stops exactly the process it started. By default it serves plain ``http://``
without authentication; ``tls=EtcdTLS(...)`` serves ``https://`` (and, with
``client_cert_auth``, requires client certificates and takes a certificate's
CN as the etcd user), ``auth_token_ttl`` sets how long an idle auth token
lives (etcd's ``--auth-token-ttl``, 300 s by default), and :meth:`etcdctl`
runs ``etcdctl`` against it (to add users and roles and ``auth enable``).
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

from partq.kernel.errors import PartqError

__all__ = ["EtcdTLS", "LocalEtcd", "free_port"]


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


@dataclass(frozen=True)
class EtcdTLS:
    """The server's certificate and key, and the CA that signed it (clients verify with it).

    With ``client_cert_auth`` etcd also requires a client certificate signed by ``ca``
    (``--trusted-ca-file``, ``--client-cert-auth``); once auth is enabled, a request
    without a token runs as the user named by the certificate's CN.
    """

    cert: Path
    key: Path
    ca: Path
    client_cert_auth: bool = False


@dataclass
class LocalEtcd:
    """``with LocalEtcd() as etcd: etcd.endpoint`` — a throwaway single-node etcd."""

    data_dir: Path | None = None
    port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    tls: EtcdTLS | None = None
    auth_token_ttl: int | None = None  # seconds; etcd's default is 300
    name: str = "partq-test"
    # --initial-cluster: "name=peer URL,…" of every member (a cluster); None: this one alone
    initial_cluster: str | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def _security_args(self) -> list[str]:
        args: list[str] = []
        if self.tls is not None:
            args += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key)]
            if self.tls.client_cert_auth:
                args += ["--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        if self.auth_token_ttl is not None:
            args += ["--auth-token", "simple", "--auth-token-ttl", str(self.auth_token_ttl)]
        return args

    def enable_auth(self, root_password: str) -> None:
        """Add etcd's ``root`` user with ``root_password`` and turn authentication on."""
        self.etcdctl("user", "add", f"root:{root_password}")
        self.etcdctl("auth", "enable")

    def etcdctl(
        self,
        *args: str,
        user: str | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        stdin: str | None = None,
        timeout: float = 20.0,
    ) -> str:
        """Run ``etcdctl ARGS`` against this server (``user`` is ``name:password``); stdout.

        ``stdin`` is its input (``user passwd NAME --interactive=false`` reads the password
        there). A failure raises :class:`PartqError` with etcdctl's stderr.
        """
        binary = shutil.which("etcdctl") or "/usr/bin/etcdctl"
        command = [binary, "--endpoints", self.endpoint, "--command-timeout", "10s"]
        if self.tls is not None:
            command += ["--cacert", str(self.tls.ca)]
        if cert is not None and key is not None:
            command += ["--cert", str(cert), "--key", str(key)]
        if user is not None:
            command += ["--user", user]
        env = {"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}
        done = subprocess.run(
            [*command, *args],
            input=(stdin or "").encode(),
            capture_output=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            shown = " ".join(a if ":" not in a or a.startswith("/") else "***" for a in args)
            raise PartqError(
                f"etcdctl {shown} failed ({done.returncode}): {done.stderr.decode().strip()}"
            )
        return done.stdout.decode()

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
                "--name", self.name,
                "--data-dir", str(self.data_dir / "data"),
                "--listen-client-urls", self.endpoint,
                "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", self.peer_url,
                "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", self.initial_cluster or f"{self.name}={self.peer_url}",
                "--log-level", "warn",
                *self._security_args(),
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

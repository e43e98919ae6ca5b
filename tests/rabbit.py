"""Private RabbitMQ nodes on loopback, started and stopped by tests: the machine's
version with TLS (:class:`PrivateRabbit`) and 4.0.5 from a trixie tree (:class:`TreeRabbit`).

The machine's broker is never touched: the node has its own name, ports, epmd,
data and log directories, cookie (``HOME``) and config files, and is stopped by
PID. ``/usr/lib/rabbitmq/bin`` scripts are called directly (the ``/usr/sbin``
wrappers switch user and drop the environment).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kernel.local import free_port

__all__ = ["RABBITMQ_40_TREE", "RABBIT_BIN", "PrivateRabbit", "TreeRabbit", "node_env"]

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")


def node_env(
    directory: Path, nodename: str, amqp_port: int, dist_port: int, epmd_port: int
) -> dict[str, str]:
    """The environment of a private node: its own name, ports, HOME (cookie), data, logs,
    config files and epmd port; for its ``rabbitmq-server`` and ``rabbitmqctl``."""
    d = directory
    return {
        **os.environ,
        "HOME": str(d),
        "RABBITMQ_NODENAME": nodename,
        "RABBITMQ_NODE_PORT": str(amqp_port),
        "RABBITMQ_DIST_PORT": str(dist_port),
        "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
        "RABBITMQ_LOG_BASE": str(d / "log"),
        "RABBITMQ_PID_FILE": str(d / "rabbit.pid"),
        "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
        "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq"),  # .conf is appended
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
        "ERL_EPMD_PORT": str(epmd_port),
        "ERL_EPMD_ADDRESS": "127.0.0.1",
    }


def stop_node(
    server: subprocess.Popen[bytes] | None, pid_file: Path, epmd: subprocess.Popen[bytes] | None
) -> None:
    """Stop a node we started: its Erlang VM (PID from ``pid_file``), what its start script
    left in its session, then its epmd."""
    if server is not None:
        with contextlib.suppress(OSError, ValueError):  # the Erlang VM
            os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
        with contextlib.suppress(OSError):  # the script's session: what it left
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
        time.sleep(0.2)
    if epmd is not None:
        epmd.terminate()
        epmd.wait(timeout=10)


@dataclass
class PrivateRabbit:
    directory: Path
    cert: Path
    key: Path
    ca: Path
    fail_if_no_peer_cert: bool = False
    name: str = "partqtls"
    plugins: tuple[str, ...] = ()
    extra_config: str = ""
    amqp_port: int = field(default_factory=free_port)
    tls_port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    epmd_port: int = field(default_factory=free_port)
    _epmd: subprocess.Popen[bytes] | None = None
    _server: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        return node_env(
            self.directory, f"{self.name}@localhost", self.amqp_port, self.dist_port, self.epmd_port
        )

    def start(self, timeout: float = 90.0) -> None:
        d = self.directory
        d.mkdir(parents=True, exist_ok=True)
        (d / "rabbitmq-env.conf").write_text("")
        (d / "enabled_plugins").write_text(f"[{','.join(self.plugins)}].\n")
        (d / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.amqp_port}\n"
            f"listeners.ssl.1 = 127.0.0.1:{self.tls_port}\n"
            f"ssl_options.cacertfile = {self.ca}\n"
            f"ssl_options.certfile = {self.cert}\n"
            f"ssl_options.keyfile = {self.key}\n"
            "ssl_options.verify = verify_peer\n"
            f"ssl_options.fail_if_no_peer_cert = {str(self.fail_if_no_peer_cert).lower()}\n"
            "auth_mechanisms.1 = PLAIN\n"
            "auth_mechanisms.2 = AMQPLAIN\n"
            "auth_mechanisms.3 = EXTERNAL\n"
            "loopback_users = none\n"
            f"{self.extra_config}"
        )
        with (d / "server.out").open("wb") as log:  # the children keep their copies
            self._epmd = subprocess.Popen(
                ["epmd", "-port", str(self.epmd_port)],
                env=self.env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            self._server = subprocess.Popen(
                [str(RABBIT_BIN / "rabbitmq-server")], env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            self.ctl("wait", "--timeout", str(int(timeout)), str(d / "rabbit.pid"),
                     timeout=timeout + 10)  # fmt: skip
        except Exception:
            self.stop()
            tail = (d / "server.out").read_text()[-2000:]
            raise RuntimeError(f"RabbitMQ did not start: {tail}") from None

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        done = subprocess.run(
            [str(RABBIT_BIN / "rabbitmqctl"), *args],
            env=self.env, capture_output=True, text=True, timeout=timeout, check=True,
        )  # fmt: skip
        return done.stdout

    def stop(self) -> None:
        stop_node(self._server, self.directory / "rabbit.pid", self._epmd)
        self._server = self._epmd = None


RABBITMQ_40_TREE = Path(os.environ.get("PARTQ_RABBITMQ_40_TREE", "/var/cache/partq/rabbitmq-4.0.5"))


@dataclass
class TreeRabbit:
    """A private RabbitMQ 4.0.5 node run chrooted in the trixie tree ``.ci/rabbitmq-4.0``
    builds: plain AMQP on a free loopback port, guest/guest, its own epmd and directory
    inside the tree. ``/proc`` is mounted in the tree while a node runs (and unmounted
    by the last one that mounted it); everything is stopped by PID."""

    tree: Path = RABBITMQ_40_TREE
    name: str = field(default_factory=lambda: f"partq40-{os.getpid()}-{free_port()}")
    amqp_port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    epmd_port: int = field(default_factory=free_port)
    _epmd: subprocess.Popen[bytes] | None = None
    _server: subprocess.Popen[bytes] | None = None
    _mounted: bool = False

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/%2F"

    @property
    def inside(self) -> Path:
        """The node's directory as the chrooted node sees it."""
        return Path("/tmp") / self.name

    @property
    def outside(self) -> Path:
        return self.tree / "tmp" / self.name

    @property
    def version(self) -> str:
        return (self.tree / ".partq-complete").read_text().strip()

    @property
    def env(self) -> dict[str, str]:
        d = self.inside
        return {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "HOME": str(d),
            "RABBITMQ_NODENAME": f"{self.name}@localhost",
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_PID_FILE": str(d / "rabbit.pid"),
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }

    def start(self, timeout: float = 90.0) -> TreeRabbit:
        if not (self.tree / ".partq-complete").exists():
            raise RuntimeError(
                f"no RabbitMQ 4.0 tree at {self.tree}: run .ci/setup (or .ci/rabbitmq-4.0)"
            )
        proc = self.tree / "proc"
        if not os.path.ismount(proc):
            subprocess.run(["mount", "-t", "proc", "proc", str(proc)], check=True)
            self._mounted = True
        d = self.outside
        d.mkdir(parents=True)
        (d / "rabbitmq-env.conf").write_text("")
        (d / "enabled_plugins").write_text("[].\n")
        (d / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.amqp_port}\nloopback_users = none\n"
        )
        chroot = ["chroot", str(self.tree)]
        with (d / "server.out").open("wb") as log:
            self._epmd = subprocess.Popen(
                [*chroot, "epmd", "-port", str(self.epmd_port)],
                env=self.env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            self._server = subprocess.Popen(
                [*chroot, "/usr/lib/rabbitmq/bin/rabbitmq-server"], env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            self.ctl("wait", "--timeout", str(int(timeout)), str(self.inside / "rabbit.pid"),
                     timeout=timeout + 10)  # fmt: skip
        except Exception:
            tail = (d / "server.out").read_text(errors="replace")[-2000:]
            self.stop()
            raise RuntimeError(f"RabbitMQ 4.0 did not start: {tail}") from None
        return self

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        done = subprocess.run(
            ["chroot", str(self.tree), "/usr/lib/rabbitmq/bin/rabbitmqctl", *args],
            env=self.env, capture_output=True, text=True, timeout=timeout, check=True,
        )  # fmt: skip
        return done.stdout

    def stop(self) -> None:
        stop_node(self._server, self.outside / "rabbit.pid", self._epmd)
        self._server = self._epmd = None
        if self._mounted:
            self._mounted = False
            subprocess.run(["umount", str(self.tree / "proc")], check=False)
        shutil.rmtree(self.outside, ignore_errors=True)

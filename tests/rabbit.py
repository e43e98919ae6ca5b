"""Private RabbitMQ nodes on loopback, started and stopped by tests: the machine's
version (TLS optional) and 4.0.5 from a trixie tree (:class:`PrivateRabbit`, :class:`Install`).

The machine's broker is never touched: the node has its own name, ports, epmd,
data and log directories, cookie (``HOME``) and config files, and is stopped by
PID. ``/usr/lib/rabbitmq/bin`` scripts are called directly (the ``/usr/sbin``
wrappers switch user and drop the environment).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from partq.kernel.local import free_port

__all__ = [
    "MACHINE",
    "RABBITMQ_40_TREE",
    "RABBIT_BIN",
    "TREE_40",
    "Install",
    "PrivateRabbit",
    "node_env",
    "tree_rabbit",
]

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
RABBITMQ_40_TREE = Path(os.environ.get("PARTQ_RABBITMQ_40_TREE", "/var/cache/partq/rabbitmq-4.0.5"))


@dataclass(frozen=True)
class Install:
    """Where private nodes' scripts come from: the machine's package (``root`` ``/``), or a
    tree ``.ci/rabbitmq-4.0`` builds, whose scripts run chrooted in it. A chrooted node's
    files must be inside the tree (:meth:`home`); :meth:`inside` is a path as it sees it."""

    root: Path = Path("/")

    @property
    def chrooted(self) -> bool:
        return self.root != Path("/")

    def available(self) -> bool:
        if self.chrooted:
            return (self.root / ".partq-complete").exists()
        return (RABBIT_BIN / "rabbitmq-server").exists() and shutil.which("epmd") is not None

    @property
    def version(self) -> str:
        if self.chrooted:
            return (self.root / ".partq-complete").read_text().strip()
        return "machine"

    def command(self, program: str, *args: str) -> list[str]:
        """``program`` (``epmd`` or a script of ``/usr/lib/rabbitmq/bin``) with ``args``."""
        path = program if program == "epmd" else str(RABBIT_BIN / program)
        return [*(["chroot", str(self.root)] if self.chrooted else []), path, *args]

    def program(self, script: str, directory: Path) -> Path:
        """One executable that runs ``script`` (for a command that takes a path, such as
        ``partq security roles --rabbitmqctl``): a wrapper in ``directory`` if chrooted."""
        if not self.chrooted:
            return RABBIT_BIN / script
        wrapper = directory / f"{script}-{self.version}"
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.join(self.command(script))} "$@"\n')
        wrapper.chmod(0o755)
        return wrapper

    def home(self, directory: Path, name: str) -> Path:
        """A node's directory: ``directory``, or for a chrooted node one in the tree."""
        return (
            self.root / "tmp" / f"{name}-{os.getpid()}-{free_port()}"
            if self.chrooted
            else directory
        )

    def inside(self, path: Path) -> Path:
        return Path("/") / path.relative_to(self.root) if self.chrooted else path

    def base_env(self) -> dict[str, str]:
        if not self.chrooted:
            return dict(os.environ)
        return {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def mount(self) -> None:
        """Mount ``/proc`` in the tree (a node needs it) unless it is."""
        proc = self.root / "proc"
        if self.chrooted and not os.path.ismount(proc):
            subprocess.run(["mount", "-t", "proc", "proc", str(proc)], check=True)

    def unmount(self) -> None:
        """Unmount the tree's ``/proc`` once no process runs in the tree (a node of this
        test, another test's, or another session's keeps it mounted)."""
        proc = self.root / "proc"
        if self.chrooted and os.path.ismount(proc) and not _processes_in(self.root):
            subprocess.run(["umount", str(proc)], check=False)


def _processes_in(root: Path) -> list[int]:
    """PIDs of processes whose root directory is ``root`` (chrooted in it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if Path(os.readlink(entry / "root")) == root:
                    found.append(int(entry.name))
    return found


MACHINE = Install()
TREE_40 = Install(RABBITMQ_40_TREE)


def node_env(
    install: Install,
    directory: Path,
    nodename: str,
    amqp_port: int,
    dist_port: int,
    epmd_port: int,
) -> dict[str, str]:
    """The environment of a private node whose files are in ``directory`` (as seen from
    outside): its own name, ports, HOME (cookie), data, logs, config files and epmd port;
    for its ``rabbitmq-server`` and ``rabbitmqctl``."""
    d = install.inside(directory)
    return {
        **install.base_env(),
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


def write_cookie(directory: Path, cookie: str | None = None) -> None:
    """Give a node (HOME ``directory``) its Erlang cookie before anything starts there.
    Left to Erlang, the server and ``rabbitmqctl wait`` race to create it, and the loser
    reads the file empty: "Too short cookie string" (CI, 2026-12-02)."""
    path = directory / ".erlang.cookie"
    path.unlink(missing_ok=True)  # read-only once written
    path.write_text(cookie or secrets.token_hex(16))
    path.chmod(0o400)


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


class PortTaken(RuntimeError):
    """A private node did not start because one of its ports was in use."""


T = TypeVar("T")

_PORT_TAKEN = ("already_used", "eaddrinuse", "address already in use")


def start_error(what: str, tail: str) -> RuntimeError:
    """The error of a node that did not start (``tail``: the end of its log):
    :class:`PortTaken` where the log says a port was in use."""
    taken = any(sign in tail.lower() for sign in _PORT_TAKEN)
    return (PortTaken if taken else RuntimeError)(f"{what} did not start: {tail}")


def on_new_ports(start: Callable[[], T], new_ports: Callable[[], None], attempts: int) -> T:
    """``start()``; where it raised :class:`PortTaken`, ``new_ports()`` and again, up to
    ``attempts`` times in all. ``free_port`` only finds a port free when it asks: another
    process may take it before the node binds it (CI, 2026-12-02, ``dist_port_already_used``).
    ``start`` must have stopped what it started before it raises."""
    for _ in range(attempts - 1):
        try:
            return start()
        except PortTaken:
            new_ports()
    return start()


@dataclass
class PrivateRabbit:
    """A private node of ``install`` (the machine's RabbitMQ, or 4.0.5 chrooted in the
    tree: ``install=TREE_40``), plain AMQP on ``amqp_port`` (``url``, guest/guest) and,
    given ``cert``/``key``/``ca``, TLS on ``tls_port``. Files in ``directory`` (in the tree
    for a chrooted node, TLS files copied there, all removed on stop)."""

    directory: Path
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    fail_if_no_peer_cert: bool = False
    name: str = "partqtls"
    plugins: tuple[str, ...] = ()
    extra_config: str = ""
    install: Install = MACHINE
    amqp_port: int = field(default_factory=free_port)
    tls_port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    epmd_port: int = field(default_factory=free_port)
    _epmd: subprocess.Popen[bytes] | None = None
    _server: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.directory = self.install.home(self.directory, self.name)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/%2F"

    @property
    def env(self) -> dict[str, str]:
        return node_env(
            self.install, self.directory, f"{self.name}@localhost", self.amqp_port,
            self.dist_port, self.epmd_port,
        )  # fmt: skip

    def _tls_config(self) -> str:
        if self.cert is None or self.key is None or self.ca is None:
            return ""
        found = {}
        for what, given in (
            ("cacertfile", self.ca),
            ("certfile", self.cert),
            ("keyfile", self.key),
        ):
            # a chrooted node sees only the tree: a copy in its directory
            path = self.directory / f"tls-{what}.pem" if self.install.chrooted else given
            if path != given:
                shutil.copy(given, path)
            found[what] = self.install.inside(path)
        return (
            f"listeners.ssl.1 = 127.0.0.1:{self.tls_port}\n"
            + "".join(f"ssl_options.{what} = {path}\n" for what, path in found.items())
            + "ssl_options.verify = verify_peer\n"
            f"ssl_options.fail_if_no_peer_cert = {str(self.fail_if_no_peer_cert).lower()}\n"
            "auth_mechanisms.1 = PLAIN\n"
            "auth_mechanisms.2 = AMQPLAIN\n"
            "auth_mechanisms.3 = EXTERNAL\n"
        )

    def start(self, timeout: float = 90.0, attempts: int = 3) -> PrivateRabbit:
        """Start the node, again on new ports where one was taken (:func:`on_new_ports`)."""
        return on_new_ports(lambda: self._start(timeout), self._new_ports, attempts)

    def _new_ports(self) -> None:
        self.amqp_port, self.tls_port = free_port(), free_port()
        self.dist_port, self.epmd_port = free_port(), free_port()

    def _start(self, timeout: float) -> PrivateRabbit:
        if not self.install.available():
            raise RuntimeError(
                f"no RabbitMQ at {self.install.root}: run .ci/setup (or .ci/rabbitmq-4.0)"
            )
        d = self.directory
        d.mkdir(parents=True, exist_ok=True)
        write_cookie(d)
        (d / "rabbitmq-env.conf").write_text("")
        (d / "enabled_plugins").write_text(f"[{','.join(self.plugins)}].\n")
        (d / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.amqp_port}\n"
            f"{self._tls_config()}"
            "loopback_users = none\n"
            f"{self.extra_config}"
        )
        self.install.mount()
        with (d / "server.out").open("wb") as log:  # the children keep their copies
            self._epmd = subprocess.Popen(
                self.install.command("epmd", "-port", str(self.epmd_port)),
                env=self.env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            self._server = subprocess.Popen(
                self.install.command("rabbitmq-server"), env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            pid_file = str(self.install.inside(d / "rabbit.pid"))
            self.ctl("wait", "--timeout", str(int(timeout)), pid_file, timeout=timeout + 10)
        except Exception:
            tail = (d / "server.out").read_text(errors="replace")[-2000:]
            self.stop()
            raise start_error(f"RabbitMQ ({self.install.version})", tail) from None
        return self

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        done = subprocess.run(
            self.install.command("rabbitmqctl", *args),
            env=self.env, capture_output=True, text=True, timeout=timeout, check=True,
        )  # fmt: skip
        return done.stdout

    def stop(self, *, keep_data: bool = False) -> None:
        """Stop the node; a chrooted node's files are removed from the shared tree unless
        ``keep_data`` (to start it again with its queues)."""
        stop_node(self._server, self.directory / "rabbit.pid", self._epmd)
        self._server = self._epmd = None
        self.install.unmount()
        if self.install.chrooted and not keep_data:
            shutil.rmtree(self.directory, ignore_errors=True)


def tree_rabbit(install: Install = TREE_40) -> PrivateRabbit:
    """A private RabbitMQ 4.0.5 node chrooted in the trixie tree ``.ci/rabbitmq-4.0``
    builds: plain AMQP on a free loopback port, guest/guest, its own epmd and directory
    inside the tree. ``/proc`` is mounted in the tree while a node runs; everything is
    stopped by PID."""
    return PrivateRabbit(Path("/tmp"), name=f"partq40-{os.getpid()}", install=install)

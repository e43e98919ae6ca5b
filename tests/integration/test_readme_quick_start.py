"""The quick start, run as written: its files written, its commands typed into one
bash in order, its daemons started in their own "terminals", and what it says you will
see checked.

The test changes no command. It sets only environment variables: a private etcd's ports
(``ETCD_*``, which the ``etcd`` command reads; ``PARTQ_ETCD_ENDPOINTS``), a private
RabbitMQ virtual host (``PARTQ_AMQP_URL``), any free HTTP port (``PARTQ_HTTP_PORT=0``) and
``PATH`` (this checkout's venv). Markers in the page that holds it (README.md or one page
of docs/, HTML comments) say which block is
a file, which a daemon's terminal, which output must appear verbatim, and where the user
presses Ctrl-C.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from partq.consumers.control.daemon import NO_LEADER_WARNING

from partq.kernel.local import free_port
from tests.integration.groups.harness import ROOT, Proc
from tests.polling import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

_MARKER = re.compile(r"<!-- quickstart:(\w+)\s*(.*?)\s*-->")


@dataclass
class Block:
    """A fenced block of the quick start and the marker just before it (if any)."""

    lang: str
    text: str
    marker: str = ""
    args: list[str] = field(default_factory=list)

    def commands(self) -> list[str]:
        return [line for line in self.text.splitlines() if line.strip()]


def quick_start_page() -> Path:
    """The one page (README.md, or the page of docs/ it moved to) with the quick start."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    found = [p for p in pages if "<!-- quickstart:begin -->" in p.read_text(encoding="utf-8")]
    assert len(found) == 1, f"{len(found)} quick starts marked in README.md and docs/"
    return found[0]


def quick_start(readme: str) -> list[Block]:
    """The fenced blocks between ``<!-- quickstart:begin -->`` and ``end``."""
    begin, end = readme.index("<!-- quickstart:begin -->"), readme.index("<!-- quickstart:end -->")
    blocks: list[Block] = []
    marker: tuple[str, list[str]] = ("", [])
    lines = iter(readme[begin:end].splitlines())
    for line in lines:
        if found := _MARKER.fullmatch(line.strip()):
            marker = (found[1], found[2].split())
        elif line.startswith("```"):
            body = []
            for inner in lines:
                if inner.startswith("```"):
                    break
                body.append(inner)
            blocks.append(Block(line[3:].strip(), "\n".join(body) + "\n", *marker))
            marker = ("", [])
    return blocks


class Shell:
    """One bash, fed commands one at a time as a user types them; their output and status."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.background: list[int] = []  # PIDs of the commands run with `&`
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, command: str, timeout: float = 90.0) -> tuple[int, str]:
        assert self.process.stdin is not None
        done = f"__quickstart_{uuid.uuid4().hex}__"
        self.process.stdin.write(f"{command}\necho {done} $?\n")
        self.process.stdin.flush()
        output: list[str] = []
        deadline = time.monotonic() + timeout
        while True:  # each turn takes a line; bounded by the deadline
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{command!r} ran past {timeout}s: {output}") from None
            if line is None:
                raise AssertionError(f"bash exited during {command!r}: {output}")
            if line.startswith(done):
                if command.endswith("&"):
                    self.background.append(int(self.run("echo $!")[1]))
                return int(line.split()[1]), "".join(output)
            output.append(line)

    def close(self) -> None:
        """End what the commands left running (by PID), then bash."""
        for pid in self.background:
            if running(pid):
                os.kill(pid, signal.SIGTERM)
        for pid in self.background:
            if not wait_gone(pid, 15):
                os.kill(pid, signal.SIGKILL)
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.close()
        self.process.wait(10)
        self.reader.join(10)
        self.process.stdout.close()


def running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for bash to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    try:
        wait_until(lambda: not running(pid), timeout, what=f"process {pid} to exit")
    except AssertionError:
        return False
    return True


def quick_start_env(amqp_url: str) -> tuple[dict[str, str], str]:
    """A user's shell with partq's venv first on PATH and nothing of partq's set, plus the
    private etcd's ports and the vhost; and that etcd's endpoint."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARTQ_", "ETCD"))}
    env.pop("PYTHONPATH", None)
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    env.update(
        PATH=f"{ROOT / '.venv' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
        ETCD_LISTEN_CLIENT_URLS=client,
        ETCD_ADVERTISE_CLIENT_URLS=client,
        ETCD_LISTEN_PEER_URLS=peer,
        ETCD_INITIAL_ADVERTISE_PEER_URLS=peer,
        ETCD_INITIAL_CLUSTER=f"default={peer}",
        PARTQ_ETCD_ENDPOINTS=client,
        PARTQ_AMQP_URL=amqp_url,
        PARTQ_HTTP_PORT="0",
    )
    return env, client


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def log_of(proc: Proc) -> str:
    return proc.log.read_text(errors="replace") if proc.log.exists() else ""


def records(proc: Proc) -> list[dict[str, object]]:
    """The daemon's log records (JSON lines: its output is not a terminal), in order."""
    found = []
    for line in log_of(proc).splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            found.append({"message": line})
    return found


def messages(proc: Proc) -> list[str]:
    return [str(r.get("message")) for r in records(proc)]


def test_the_readme_quick_start_runs_as_written(vhost: str, tmp_path: Path) -> None:
    # Given the quick start's blocks, and an empty folder to follow it in
    page = quick_start_page()
    blocks = quick_start(page.read_text(encoding="utf-8"))
    env, etcd = quick_start_env(vhost)
    shell = Shell(tmp_path, env)
    daemons: dict[str, Proc] = {}

    def consumer_says(text: str, timeout: float = 60) -> None:
        def said() -> bool:
            assert daemons["consumer"].alive(), log_of(daemons["consumer"])[-3000:]
            return any(text in m for m in messages(daemons["consumer"]))

        wait_until(said, timeout, what=f"the consumer to log {text!r}")

    def dlq_json() -> dict[str, object]:
        done = subprocess.run(
            ["partq", "dlq", "list", "orders", "--json"],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=True,
        )  # fmt: skip
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    def handled() -> list[str]:
        """What the handler logged: "alice: order 0 (partition 1)"."""
        found = records(daemons["consumer"])
        mine = [r for r in found if r.get("logger") == "myhandlers"]
        return [f"{r['message']} (partition {r['partition']})" for r in mine]

    def parked() -> list[tuple[object, object]]:
        keys = dlq_json()["parked"]
        assert isinstance(keys, list)
        return [(k["key"], k["messages"]) for k in keys]

    # What the quick start says each step shows
    def after_etcd(_out: str) -> None:
        wait_until(lambda: answers(f"{etcd}/health"), 20, what="etcd to answer")

    def after_consumer() -> None:
        # a consumer without a coordinator says so within seconds, naming the command
        consumer_says("start one with `partq coordinator orders`", NO_LEADER_WARNING + 30)

    def after_coordinator() -> None:
        consumer_says("a coordinator now runs for stream orders")
        for p in range(4):
            consumer_says(f"partition {p}: consuming")

    def after_publish(out: str) -> None:
        wait_until(lambda: len(handled()) == 12, 60, what="12 orders handled")
        wait_until(lambda: parked() == [("mallory", 3)], 60, what="mallory's 3 orders parked")
        assert not any(m.startswith("mallory:") for m in handled())
        bob = [m for m in handled() if m.startswith("bob:")]
        assert bob == [f"bob: order {n} (partition 2)" for n in (1, 6, 11)], bob

    def after_status(out: str) -> None:
        assert "members (1):" in out and "parked keys: mallory" in out, out
        assert out.count("consumers") >= 1 and "unassigned: -" in out, out
        # and the status page, on the port the coordinator logged (the quick start's 9400 is
        # the default; PARTQ_HTTP_PORT=0 let it take any free port)
        logged = next(m for m in messages(daemons["coordinator"]) if "status page on" in m)
        page = urllib.request.urlopen(logged.rsplit(" ", 1)[1], timeout=10).read().decode()
        assert "mallory" in page and "orders" in page, page[:2000]

    def after_list(out: str) -> None:
        row = next(line for line in out.splitlines() if line.startswith("mallory "))
        assert row.split()[1:3] == ["2", "3"], row
        assert "ValueError: no address for mallory (order 4)" in row, row

    def after_redrive(out: str) -> None:
        assert parked() == []
        mallory = [m for m in handled() if m.startswith("mallory:")]
        assert mallory == [f"mallory: order {n} (partition 2)" for n in (4, 9, 14)], mallory

    def after_kill_etcd(_out: str) -> None:
        assert wait_gone(shell.background[0], 20), "etcd still runs after `kill %1`"

    checks: dict[str, Callable[[str], None]] = {
        "etcd --data-dir etcd-data > etcd.log 2>&1 &": after_etcd,
        "python publish.py": after_publish,
        "partq status orders": after_status,
        "partq dlq list orders": after_list,
        "partq dlq redrive orders --key mallory": after_redrive,
        "kill %1": after_kill_etcd,
    }
    started: dict[str, Callable[[], None]] = {
        "consumer": after_consumer,
        "coordinator": after_coordinator,
    }
    try:
        # When every block is followed in order
        last: tuple[str, str] = ("", "")
        for block in blocks:
            if block.marker == "file":
                (tmp_path / block.args[0]).write_text(block.text)
            elif block.marker == "terminal":
                (command,) = block.commands()
                assert not set(command) & set("&|;<>$`"), "a terminal block is one command"
                name = block.args[0]
                log = tmp_path / f"{name}.log"
                with log.open("ab") as sink:
                    popen = subprocess.Popen(
                        shlex.split(command), stdout=sink, stderr=subprocess.STDOUT,
                        env=env, cwd=tmp_path,
                    )  # fmt: skip
                daemons[name] = Proc(name, popen, log)
                started.pop(name)()
            elif block.marker == "output":
                # Then what the quick start shows appears verbatim in the command's output
                for line in block.commands():
                    assert line in last[1], f"{last[0]!r} did not print {line!r}:\n{last[1]}"
            elif block.lang == "sh":
                for name in block.args if block.marker == "stop" else []:
                    daemons[name].signal(signal.SIGINT)  # Ctrl-C in its terminal
                    assert daemons[name].popen.wait(60) == 0, log_of(daemons[name])[-3000:]
                for command in block.commands():
                    code, out = shell.run(command)
                    assert code == 0, f"{command!r} exited {code}:\n{out}"
                    last = (command, out)
                    if command in checks:
                        checks.pop(command)(out)
        # And every step the test knows of was in the quick start, and checked
        assert not checks and not started, f"not in the quick start: {[*checks, *started]}"
        assert "**http://127.0.0.1:9400/**" in page.read_text(encoding="utf-8")
    finally:
        for proc in daemons.values():
            proc.terminate()
        shell.close()

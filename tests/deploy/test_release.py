"""The release as it ships: ``python -m build``'s wheel and sdist, the wheel installed in a
clean virtualenv and run from outside the source tree (what the Docker image does), and the
versions deploy/ names.

There is no Docker daemon here, so the image itself is never built: the Dockerfile's test
(test_compose.py) checks that it installs this wheel; this file checks that the wheel runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from partq.coordinator.ops import admin
from partq.producer import StreamNotFound
from partq.producer.registry import Registry

from partq.kernel.settings import Settings
from tests.deploy.conftest import DEPLOY, REPO
from tests.integration.groups.harness import Proc
from tests.polling import wait_until

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION: str = PYPROJECT["project"]["version"]
# package -> the repository folder it is built from
FOLDERS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]


# ---------------------------------------------------------------- versions deploy/ names


def rabbitmq_ci_tests() -> str:
    """The RabbitMQ version CI tests beside the machine's (.ci/rabbitmq-4.0 checks it)."""
    found = re.search(
        r"\[\[ \$version == ([0-9.]+)\* \]\]", (REPO / ".ci/rabbitmq-4.0").read_text()
    )
    assert found, ".ci/rabbitmq-4.0 no longer names the version it installs"
    return found.group(1)


def images(path: Path) -> list[str]:
    """Every ``image:`` of a YAML file (compose services or Kubernetes containers)."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            image = node.get("image")
            if isinstance(image, str):
                found.append(image)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for doc in yaml.safe_load_all(path.read_text()):
        walk(doc)
    return found


def test_compose_and_the_manifests_run_the_rabbitmq_ci_tests() -> None:
    tested = rabbitmq_ci_tests()
    rabbits = {
        f"{path.relative_to(REPO)}: {image}"
        for path in sorted(DEPLOY.rglob("*.y*ml"))
        for image in images(path)
        if image.split(":")[0].rsplit("/", 1)[-1] == "rabbitmq"
    }
    assert len(rabbits) >= 2, rabbits  # compose and the dev overlay
    wrong = {r for r in rabbits if not r.split(": ", 1)[1].startswith(f"rabbitmq:{tested}-")}
    assert not wrong, f"not the RabbitMQ CI tests ({tested}): {sorted(wrong)}"


def test_the_manifests_image_tag_is_the_release() -> None:
    tags = {
        str(path.relative_to(REPO)): image["newTag"]
        for path in sorted((DEPLOY / "k8s").rglob("kustomization.yaml"))
        for image in yaml.safe_load(path.read_text()).get("images", [])
        if image["name"] == "partq"
    }
    # the base names the release; an overlay names it too, or an image built locally (dev)
    assert tags["deploy/k8s/base/kustomization.yaml"] == VERSION, tags
    assert set(tags.values()) <= {VERSION, "dev"}, tags


def test_the_changelog_has_the_release() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text
    assert re.search(rf"^## \[{re.escape(VERSION)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M)


def test_partq_version_is_pyprojects() -> None:
    result = subprocess.run(
        [str(Path(sys.executable).with_name("partq")), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.stdout.strip() == f"partq, version {VERSION}", result.stderr


# ---------------------------------------------------------------- the built release


@dataclass(frozen=True)
class Release:
    wheel: Path
    sdist: Path
    venv: Path
    home: Path  # a folder outside the source tree, to run from

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def env(self, **extra: str) -> dict[str, str]:
        environ = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PARTQ_", "PYTHON", "VIRTUAL_ENV"))
        }
        return {**environ, "PYTHONUNBUFFERED": "1", **extra}

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.bin("partq"), *args],
            capture_output=True,
            text=True,
            cwd=self.home,
            env=self.env(**env),
            timeout=120,
            check=False,
        )


def _checked(command: list[str], what: str, timeout: float) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, f"{what} failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}"


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """sdist and wheel from ``python -m build``; the wheel in a new virtualenv."""
    root = tmp_path_factory.mktemp("release")
    dist, venv, home = root / "dist", root / "venv", root / "home"
    home.mkdir()
    _checked(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)], "python -m build", 300
    )
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())
    _checked([sys.executable, "-m", "venv", str(venv)], "python -m venv", 120)
    _checked([str(venv / "bin" / "pip"), "install", "-q", str(wheels[0])], "pip install", 600)
    return Release(wheels[0], sdists[0], venv, home)


@pytest.mark.e2e
@pytest.mark.slow
def test_python_m_build_makes_a_wheel_and_an_sdist_of_every_package(release: Release) -> None:
    assert release.wheel.name == f"partq-{VERSION}-py3-none-any.whl"
    assert release.sdist.name == f"partq-{VERSION}.tar.gz"
    with zipfile.ZipFile(release.wheel) as wheel:
        names = wheel.namelist()
    # one top-level name, partq, beside the distribution's metadata
    top = {name.split("/")[0] for name in names}
    assert top == {"partq", f"partq-{VERSION}.dist-info"}, sorted(top)
    # every module of the folders partq is built from is in the wheel, at its package path
    for package, folder in FOLDERS.items():
        tracked = subprocess.run(
            ["git", "ls-files", f"{folder}/*.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        assert tracked, folder
        inside = {
            package.replace(".", "/") + "/" + Path(f).relative_to(folder).as_posix()
            for f in tracked
        }
        assert inside <= set(names), sorted(inside - set(names))
    assert "partq/py.typed" in names
    # and nothing of the examples, tests or benchmarks
    assert not [n for n in names if n.startswith(("partq/examples", "partq/tests", "examples/"))]


@pytest.mark.e2e
@pytest.mark.slow
def test_the_installed_wheel_starts_outside_the_source_tree(release: Release) -> None:
    # Given the wheel installed in a clean virtualenv, run from a folder outside the tree
    # When partq is asked for its help and version
    help_ = release.run("--help")
    version = release.run("--version")
    where = subprocess.run(
        [
            release.bin("python"),
            "-c",
            "import partq.cli, partq.consumers as c; print(partq.cli.__file__, c.__file__)",
        ],
        capture_output=True,
        text=True,
        cwd=release.home,
        env=release.env(),
        timeout=60,
        check=False,
    )
    # Then both answer, from the installed packages
    assert help_.returncode == 0, help_.stderr
    for command in ("coordinator", "consume", "produce", "stream", "spark-job", "dlq"):
        assert command in help_.stdout
    assert version.stdout.strip() == f"partq, version {VERSION}", version.stderr
    assert where.returncode == 0, where.stderr
    for path in where.stdout.split():
        assert Path(path).is_relative_to(release.venv), path


@pytest.fixture
def stream(registry: Registry, rabbitmq: str, stream_name: str) -> Iterator[str]:
    yield stream_name
    with contextlib.suppress(StreamNotFound):
        admin.delete(registry, rabbitmq, stream_name)


@contextlib.contextmanager
def daemon(release: Release, name: str, *args: str, **env: str) -> Iterator[Proc]:
    """``partq ARGS`` of the release, logging to a file; stopped by its PID on the way out."""
    log = release.home / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            [release.bin("partq"), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=release.home,
            env=release.env(**env),
        )
    proc = Proc(name, popen, log)
    try:
        yield proc
    finally:
        proc.terminate()


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.slow
def test_a_coordinator_and_a_consumer_of_the_wheel_handle_a_stream(
    release: Release, settings: Settings, stream: str
) -> None:
    env = {"PARTQ_ETCD_ENDPOINTS": settings.etcd_endpoints, "PARTQ_AMQP_URL": settings.amqp.url}
    # Given a stream the release's CLI created
    created = release.run("stream", "create", stream, "--partitions", "2", **env)
    assert created.returncode == 0, created.stderr
    # And a handler module of the user's, in a folder that also holds modules named like
    # partq's old top-level packages (they once hid the SDK)
    (release.home / "handlers.py").write_text(
        "from partq import Message\n\n"
        "def handle(message: Message) -> None:\n"
        "    print('handled', message.body.decode(), flush=True)\n"
    )
    for shadow in ("producer", "cli", "kernel", "consumers", "coordinator"):
        (release.home / f"{shadow}.py").write_text(
            f"raise ImportError('the user\\'s {shadow}.py')\n"
        )
    # When its coordinator and a consumer with that handler run, and a message is sent
    coordinator = ["coordinator", stream, "--settle", "0.5", "--http-port", "0"]
    handler = "handlers:handle"
    consume = ["consume", stream, "--handler", handler, "--http-port", "0", "--ttl", "2"]
    with (
        daemon(release, "coordinator", *coordinator, **env) as leader,
        daemon(release, "consumer", *consume, **env) as consumer,
    ):
        sent = release.run("produce", stream, "--key", "k1", "--body", "from-the-wheel", **env)
        assert sent.returncode == 0, sent.stderr

        # Then the consumer handles it, and both stop cleanly on SIGTERM
        def handled() -> bool:
            assert consumer.alive(), f"the consumer exited:\n{consumer.tail()}"
            assert leader.alive(), f"the coordinator exited:\n{leader.tail()}"
            return "from-the-wheel" in consumer.log.read_text(errors="replace")

        wait_until(handled, 90, what="the message handled by the wheel's consumer")
        assert consumer.terminate() == 0, consumer.tail()
        assert leader.terminate() == 0, leader.tail()

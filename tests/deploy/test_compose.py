"""deploy/docker-compose.yml and the Dockerfile: parsed, and every reference checked.

There is no Docker daemon here: nothing is built or run. What can be known
offline is: the file parses, each image is pinned or built from a Dockerfile
that exists, each mounted file exists, Prometheus and Grafana are pointed at
the files the repo ships, and the image runs `partq` as a non-root user.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from partq.cli.produce import produce
from tests.deploy.conftest import DEPLOY, REPO
from tests.deploy.metric_names import (
    dashboard_expressions,
    exported_families,
    family_of,
    referenced_metrics,
)

COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
REQUIRED_SERVICES = {
    "etcd",
    "rabbitmq",
    "prometheus",
    "grafana",
    "coordinator",
    "consumers",
    "producer",
}
PARTQ_COMMANDS = {"coordinator", "consume", "produce", "stream", "status"}
DEFAULT_PORTS = {"coordinator": 9400, "consume": 9401}


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())  # type: ignore[no-any-return]


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]  # type: ignore[no-any-return]


def bind_mounts(service: dict[str, Any]) -> list[tuple[Path, PurePosixPath]]:
    """(host path, container path) of each bind mount (short syntax)."""
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append(((COMPOSE.parent / source).resolve(), PurePosixPath(target)))
    return mounts


def host_path(service: dict[str, Any], inside: str) -> Path | None:
    """The repo file a container path comes from, through the service's bind mounts."""
    wanted = PurePosixPath(inside)
    for host, target in bind_mounts(service):
        if wanted == target or target in wanted.parents:
            return host.joinpath(*wanted.relative_to(target).parts)
    return None


def partq_services() -> dict[str, dict[str, Any]]:
    return {
        name: service
        for name, service in services().items()
        if service.get("image", "").startswith("partq:")
    }


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuations joined."""
    text = re.sub(r"^\s*#.*\n", "", DOCKERFILE.read_text(), flags=re.MULTILINE)
    text = re.sub(r"\\\n", " ", text)
    found = []
    for line in text.splitlines():
        if line.strip():
            instruction, _, arguments = line.strip().partition(" ")
            found.append((instruction.upper(), arguments.strip()))
    return found


# ---------------------------------------------------------------- compose


def test_the_compose_file_runs_the_whole_system() -> None:
    assert set(services()) >= REQUIRED_SERVICES


@pytest.mark.parametrize("name", sorted(services()))
def test_each_image_is_pinned_or_built_from_a_dockerfile_that_exists(name: str) -> None:
    service = services()[name]
    assert "image" in service or "build" in service
    if "build" in service:
        context = (COMPOSE.parent / service["build"]["context"]).resolve()
        assert (context / service["build"].get("dockerfile", "Dockerfile")).is_file()
        assert context == REPO
    else:
        image = service["image"]
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else "latest"
        assert tag != "latest", f"{name}: pin {image} to a version"


@pytest.mark.parametrize("name", sorted(services()))
def test_mounted_files_exist_and_named_volumes_are_declared(name: str) -> None:
    service = services()[name]
    for host, _ in bind_mounts(service):
        assert host.exists(), f"{name} mounts {host}, which is not in the repo"
        assert REPO in host.parents, f"{name} mounts {host}, outside the repo"
    declared = set(compose().get("volumes") or {})
    for volume in service.get("volumes", []):
        source = volume.split(":")[0]
        if not source.startswith((".", "/")):
            assert source in declared, f"{name}: volume {source} is not declared"


def test_dependencies_are_services() -> None:
    for name, service in services().items():
        assert set(service.get("depends_on", [])) <= set(services()), name


def test_partq_services_run_partq_commands() -> None:
    for name, service in partq_services().items():
        command = service.get("command", [])
        if service.get("entrypoint"):  # a shell around partq (the producer)
            assert " partq produce " in f" {command[0]} ", name
        else:
            assert command[0] in PARTQ_COMMANDS, name
        env = service["environment"]
        assert {"PARTQ_ETCD_ENDPOINTS", "PARTQ_AMQP_URL"} <= set(env), name


def test_the_consumers_run_the_example_handler_and_may_finish_their_drain() -> None:
    consumers = services()["consumers"]
    command = consumers["command"]
    handler = command[command.index("--handler") + 1]
    assert handler == "examples.handlers:print_handler"
    module, _, function = handler.partition(":")
    assert callable(getattr(importlib.import_module(module), function))
    drain = float(command[command.index("--drain-timeout") + 1])
    grace = float(consumers["stop_grace_period"].removesuffix("s"))
    assert grace > drain


def test_the_daemons_listen_beyond_loopback() -> None:
    # partq's HTTP server listens on loopback by default: Prometheus could not scrape it
    for name, service in partq_services().items():
        command = service["command"]
        if command[0] in DEFAULT_PORTS:
            assert command[command.index("--http-host") + 1] in {"0.0.0.0", "::"}, name


def test_grafana_provisioning_loads_the_repos_dashboard() -> None:
    grafana = services()["grafana"]
    provisioning = host_path(grafana, "/etc/grafana/provisioning")
    assert provisioning == DEPLOY / "grafana" / "provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "partq.yml").read_text())[
        "providers"
    ]
    folder = PurePosixPath(provider["options"]["path"])
    loaded = {
        host_path(grafana, str(folder / "partq-dashboard.json")),
        *(host for host, target in bind_mounts(grafana) if folder in target.parents),
    }
    assert DEPLOY / "grafana" / "partq-dashboard.json" in loaded, (
        f"the dashboard is not mounted into the provider's folder {folder}"
    )
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path(grafana, home) == DEPLOY / "grafana" / "partq-dashboard.json"
    json.loads((DEPLOY / "grafana" / "partq-dashboard.json").read_text())
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ][0]
    assert datasource["url"].split("//")[1].split(":")[0] in services()


def test_prometheus_loads_the_repos_config_and_rules_and_scrapes_partq() -> None:
    prometheus = services()["prometheus"]
    flag = next(arg for arg in prometheus["command"] if arg.startswith("--config.file="))
    inside = PurePosixPath(flag.split("=", 1)[1])
    assert host_path(prometheus, str(inside)) == DEPLOY / "prometheus" / "prometheus.yml"
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    for rule_file in config["rule_files"]:
        assert host_path(prometheus, str(inside.parent / rule_file)) == (
            DEPLOY / "prometheus" / "alerts.yml"
        )

    # Every partq daemon is scraped on the port it serves
    scraped = scrape_targets()
    for name, service in partq_services().items():
        command = service["command"]
        if command[0] in DEFAULT_PORTS:
            port = int(
                command[command.index("--http-port") + 1]
                if "--http-port" in command
                else DEFAULT_PORTS[command[0]]
            )
            assert (name, port) in scraped, f"Prometheus does not scrape {name}:{port}"
    for host, _ in scraped - {("localhost", 9090)}:
        assert host in services(), f"scrape target {host} is not a compose service"


def scrape_targets() -> set[tuple[str, int]]:
    """(host, port) of every target the compose Prometheus scrapes."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    scraped: set[tuple[str, int]] = set()
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                scraped.add((host, int(port)))
        for dns in job.get("dns_sd_configs", []):
            scraped |= {(name, dns["port"]) for name in dns["names"]}
    return scraped


def test_prometheus_scrapes_a_producer_serving_the_dashboards_producer_metrics() -> None:
    # Given the producer series the dashboard draws (all from producer/metrics.py)
    families = exported_families(["partq.producer.metrics"])
    dashboard = DEPLOY / "grafana" / "partq-dashboard.json"
    drawn = {
        family_of(series, families)
        for _, expr in dashboard_expressions(dashboard)
        for series in referenced_metrics(expr)
    } - {None}
    assert drawn, "the dashboard draws no producer metric"
    # When the compose producer's `partq produce` command line is parsed as partq parses it
    script = services()["producer"]["command"][0]
    argv = shlex.split(script.rsplit("|", 1)[1])
    assert argv[:2] == ["partq", "produce"], argv
    with produce.make_context("produce", argv[2:]) as parsed:
        host, port = parsed.params["http_host"], parsed.params["http_port"]
    # Then it serves /metrics (every partq_producer_* series of its process) beyond
    # loopback, on a port Prometheus scrapes
    assert port is not None, "the compose producer serves no metrics (--http-port)"
    assert host in {"0.0.0.0", "::"}
    assert ("producer", port) in scrape_targets(), f"Prometheus does not scrape producer:{port}"


# ---------------------------------------------------------------- Dockerfile


def test_the_image_is_python_311_slim_running_partq_as_a_non_root_user() -> None:
    instructions = dockerfile_instructions()
    stages = [i for i, (op, _) in enumerate(instructions) if op == "FROM"]
    final = instructions[stages[-1] :]
    assert final[0][1].split()[0] == "python:3.11-slim"
    entrypoint = [args for op, args in final if op == "ENTRYPOINT"]
    assert entrypoint, "no ENTRYPOINT"
    assert json.loads(entrypoint[-1]) == ["partq"]  # exec form: signals reach partq
    users = [args for op, args in final if op == "USER"]
    assert users, "the image runs as root"
    assert users[-1].split(":")[0] not in {"root", "0"}
    exposed = {int(port) for op, args in final if op == "EXPOSE" for port in args.split()}
    assert exposed >= set(DEFAULT_PORTS.values())


def test_the_image_installs_the_wheel_python_m_build_makes() -> None:
    # Given the Dockerfile's stages
    instructions = dockerfile_instructions()
    stages = [i for i, (op, _) in enumerate(instructions) if op == "FROM"]
    assert len(stages) >= 2, "one stage builds the wheel, the last installs it"
    build, final = instructions[stages[0] : stages[-1]], instructions[stages[-1] :]
    build_stage = build[0][1].split()[-1]
    # Then the first builds the release with `python -m build`
    assert any(op == "RUN" and "python -m build" in args for op, args in build)
    # And the last copies only that stage's output and installs the wheel from it: the
    # package's own file set, never folders of the source tree
    copies = [args for op, args in final if op == "COPY"]
    assert copies, "the final stage copies nothing"
    assert all(f"--from={build_stage}" in args for args in copies), copies
    installs = [args for op, args in final if op == "RUN" and "pip install" in args]
    assert installs, "the final stage installs nothing"
    assert all(".whl" in args for args in installs), installs


def test_the_files_the_dockerfile_copies_are_in_the_repo() -> None:
    for op, args in dockerfile_instructions():
        if op == "COPY" and "--from" not in args:
            *sources, _ = shlex.split(args)
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repo"


# ---------------------------------------------------------------- credentials

CREDENTIAL = re.compile(r"://[^/\s]*:[^@/\s]*@|PASS|SECRET|TOKEN|_USER|GF_AUTH_", re.I)
MARK = "development"


def test_the_file_opens_by_saying_it_is_for_development_only() -> None:
    header = []
    for line in COMPOSE.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    assert "DEVELOPMENT ONLY" in "\n".join(header[:3])
    assert "credential" in "\n".join(header).lower()


def test_each_credential_is_marked_development_only_where_it_is_set() -> None:
    lines = COMPOSE.read_text().splitlines()
    found = 0
    for number, line in enumerate(lines):
        if line.lstrip().startswith("#") or not CREDENTIAL.search(line):
            continue
        found += 1
        # the line itself, or the comment lines right above it (a run of settings)
        above = number
        while above > 0 and not lines[above - 1].lstrip().startswith("#"):
            if lines[above - 1].strip().endswith(":"):  # the mapping's key: the run ends
                break
            above -= 1
        comments = [*lines[max(0, above - 3) : above], line]
        assert any(MARK in c.lower() for c in comments), f"line {number + 1}: {line.strip()}"
    assert found >= 4  # PARTQ_AMQP_URL, RabbitMQ's user and password, Grafana's auth


def test_no_other_service_holds_a_secret_like_setting() -> None:
    allowed = {
        "PARTQ_AMQP_URL",
        "RABBITMQ_DEFAULT_USER",
        "RABBITMQ_DEFAULT_PASS",
        "GF_AUTH_ANONYMOUS_ENABLED",
        "GF_AUTH_ANONYMOUS_ORG_ROLE",
        "GF_AUTH_DISABLE_LOGIN_FORM",
    }
    for name, service in services().items():
        environment = service.get("environment", {})
        for key in environment:
            if CREDENTIAL.search(key) or CREDENTIAL.search(str(environment[key])):
                assert key in allowed, f"{name}: {key}"


def test_published_ports_are_bound_to_loopback() -> None:
    for name, service in services().items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port}"

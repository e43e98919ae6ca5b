"""deploy/k8s: the kustomizations build, validate against Kubernetes' schemas, and hang together.

Everything is offline: `kubectl kustomize` renders, kubernetes-validate ships
the schemas. Custom resources (ServiceMonitor, ScaledObject) have no schema
there and are checked field by field.
"""

from __future__ import annotations

import base64
import importlib
import os
import re
import shlex
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import DEPLOY, KUSTOMIZATIONS, REPO, Manifest, run

Kustomize = Callable[[str], list[Manifest]]

# Oldest Kubernetes partq supports, and the newest the installed schemas know.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CUSTOM_RESOURCES = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
DEFAULT_PORTS = {"coordinator": 9400, "consume": 9401}
DEFAULT_DRAIN_SECONDS = 20
DEFAULT_GRACE_SECONDS = 30  # Kubernetes' own default
# After the drain the consumer still releases its claims and revokes its lease.
RELEASE_MARGIN_SECONDS = 5
# Secrets that must never be environment variables: the pods name files instead
PLAIN_SECRET_ENV = {"PARTQ_ETCD_PASSWORD", "PARTQ_HTTP_TOKEN"}
FILE_SETTINGS = {
    "PARTQ_ETCD_PASSWORD_FILE",
    "PARTQ_ETCD_CA",
    "PARTQ_ETCD_CERT",
    "PARTQ_ETCD_KEY",
    "PARTQ_AMQP_PASSWORD_FILE",
    "PARTQ_AMQP_URL_FILE",
    "PARTQ_AMQP_CA",
    "PARTQ_AMQP_CERT",
    "PARTQ_AMQP_KEY",
    "PARTQ_HTTP_TOKEN_FILE",
    "PARTQ_HTTP_CERT",
    "PARTQ_HTTP_KEY",
}
KEDA = DEPLOY / "k8s" / "examples" / "keda-scaledobject.yaml"

every_kustomization = pytest.mark.parametrize("name", KUSTOMIZATIONS)


# ---------------------------------------------------------------- reading manifests


def find(docs: list[Manifest], kind: str, name: str) -> Manifest:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def generated(docs: list[Manifest], kind: str, name: str) -> Manifest:
    """A ConfigMap or Secret kustomize generated (its name gets a hash suffix)."""
    matches = [
        d
        for d in docs
        if d["kind"] == kind and re.fullmatch(rf"{name}(-\w+)?", d["metadata"]["name"])
    ]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def workloads(docs: list[Manifest]) -> Iterator[Manifest]:
    return (d for d in docs if d["kind"] in WORKLOAD_KINDS)


def partq_containers(docs: list[Manifest]) -> Iterator[tuple[Manifest, dict[str, Any]]]:
    """(workload, container) for every container running the partq image."""
    for workload in workloads(docs):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if container["image"].rsplit("/", 1)[-1].split(":")[0] == "partq":
                yield workload, container


def option(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {var["name"]: var for var in container.get("env", [])}


def data_keys(doc: Manifest) -> set[str]:
    return set(doc.get("data", {})) | set(doc.get("stringData", {}))


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


# ---------------------------------------------------------------- schemas


@every_kustomization
def test_kustomize_builds(kustomize: Kustomize, name: str) -> None:
    kinds = {doc["kind"] for doc in kustomize(name)}
    assert {"ConfigMap", "Secret", "Service", "PodDisruptionBudget", "ServiceMonitor"} <= kinds


@every_kustomization
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_match_the_kubernetes_schemas(
    kustomize: Kustomize, name: str, version: str
) -> None:
    errors = []
    for doc in kustomize(name):
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_RESOURCES:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{doc['kind']} {doc['metadata']['name']}: {e.message} at {e.path}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{doc['apiVersion']} {doc['kind']}: no such kind in Kubernetes")
    assert not errors, "\n".join(errors)


@every_kustomization
def test_the_servicemonitor_scrapes_every_partq_service(kustomize: Kustomize, name: str) -> None:
    docs = kustomize(name)
    monitor = find(docs, "ServiceMonitor", "partq")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [
        d for d in docs if d["kind"] == "Service" and selects(selector, d["metadata"]["labels"])
    ]
    assert {s["metadata"]["name"] for s in services} == {"partq-coordinator", "partq-consumers"}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["path"] == "/metrics"
        for service in services:
            assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_the_keda_example_is_a_valid_scaledobject_on_queue_depth(kustomize: Kustomize) -> None:
    scaled = yaml.safe_load(KEDA.read_text())
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    find(kustomize("base"), target["kind"], target["name"])
    assert 0 < spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert urlsplit(meta["serverAddress"]).scheme in {"http", "https"}
    assert "partq_queue_messages" in meta["query"]
    assert isinstance(meta["threshold"], str) and float(meta["threshold"]) > 0
    # The HPA behaviour KEDA passes through must be one Kubernetes accepts
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "check"},
        "spec": {
            "scaleTargetRef": target,
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        },
    }
    kubernetes_validate.validate(hpa, KUBERNETES_VERSIONS[0], strict=True)


# ---------------------------------------------------------------- the daemons


@every_kustomization
def test_two_coordinators_run(kustomize: Kustomize, name: str) -> None:
    coordinator = find(kustomize(name), "Deployment", "partq-coordinator")
    assert coordinator["spec"]["replicas"] == 2
    (container,) = coordinator["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "coordinator"


@every_kustomization
def test_probes_point_at_the_daemons_endpoints(kustomize: Kustomize, name: str) -> None:
    roles = set()
    for workload, container in partq_containers(kustomize(name)):
        role = container["args"][0]
        if role not in DEFAULT_PORTS:  # a one-off command, not a daemon
            continue
        roles.add(role)
        port = int(option(container["args"], "--http-port") or DEFAULT_PORTS[role])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        expected = {
            "livenessProbe": "/livez",
            "readinessProbe": "/readyz",
            "startupProbe": "/livez",
        }
        for probe_name, path in expected.items():
            probe = container.get(probe_name)
            if probe is None and probe_name == "startupProbe":
                continue
            assert probe is not None, f"{workload['metadata']['name']} has no {probe_name}"
            get = probe["httpGet"]
            probed = ports.get(get["port"], get["port"])
            assert (get["path"], probed) == (path, port), (
                f"{workload['metadata']['name']} {probe_name}"
            )
    assert roles == {"coordinator", "consume"}


@every_kustomization
def test_the_daemons_listen_on_the_pod_ip(kustomize: Kustomize, name: str) -> None:
    # partq's HTTP server listens on loopback by default: probes and scrapes would fail
    daemons = [c for _, c in partq_containers(kustomize(name)) if c["args"][0] in DEFAULT_PORTS]
    assert daemons
    for container in daemons:
        assert option(container["args"], "--http-host") in {"0.0.0.0", "::"}, container["name"]


@every_kustomization
def test_the_grace_period_outlasts_the_drain_deadline(kustomize: Kustomize, name: str) -> None:
    consumers = [(w, c) for w, c in partq_containers(kustomize(name)) if c["args"][0] == "consume"]
    assert consumers
    for workload, container in consumers:
        drain = float(option(container["args"], "--drain-timeout") or DEFAULT_DRAIN_SECONDS)
        pod = workload["spec"]["template"]["spec"]
        grace = pod.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
        assert grace >= drain + RELEASE_MARGIN_SECONDS, (
            f"{workload['metadata']['name']}: SIGKILL after {grace}s cuts a {drain}s drain short"
        )


@every_kustomization
def test_the_consumers_run_the_handler_from_the_configmap(kustomize: Kustomize, name: str) -> None:
    docs = kustomize(name)
    for _, container in partq_containers(docs):
        if container["args"][0] != "consume":
            continue
        assert option(container["args"], "--handler") == "$(PARTQ_HANDLER)"
        ref = env_of(container)["PARTQ_HANDLER"]["valueFrom"]["configMapKeyRef"]
        handler = find(docs, "ConfigMap", ref["name"])["data"][ref["key"]]
        module, _, function = handler.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), handler


@every_kustomization
def test_arguments_only_expand_variables_the_container_defines(
    kustomize: Kustomize, name: str
) -> None:
    for workload, container in partq_containers(kustomize(name)):
        used = set(re.findall(r"\$\((\w+)\)", " ".join(container.get("args", []))))
        missing = used - set(env_of(container))
        assert not missing, f"{workload['metadata']['name']}: $({missing.pop()}) is not defined"


@every_kustomization
def test_members_are_named_after_their_pods(kustomize: Kustomize, name: str) -> None:
    for _, container in partq_containers(kustomize(name)):
        if container["args"][0] == "consume":
            member = env_of(container)["PARTQ_MEMBER_ID"]["valueFrom"]["fieldRef"]
            assert member["fieldPath"] == "metadata.name"


# ---------------------------------------------------------------- references


@every_kustomization
def test_no_secret_is_an_environment_variable_or_an_argument(
    kustomize: Kustomize, name: str
) -> None:
    # Environment and arguments show in `kubectl describe`, /proc and crash reports.
    for workload, container in partq_containers(kustomize(name)):
        where = f"{workload['metadata']['name']}/{container['name']}"
        for var in container.get("env", []):
            assert "secretKeyRef" not in var.get("valueFrom", {}), f"{where}: {var['name']}"
            assert var["name"] not in PLAIN_SECRET_ENV, f"{where}: {var['name']}: use its _FILE"
            assert not re.search(r"://[^/\s]*:[^@/\s]*@", var.get("value", "")), var["name"]
        args = " ".join(container.get("args", []))
        assert not re.search(r"--amqp-url\s+\S*:[^@/\s]*@|password|token", args, re.I), where


def mounted_secret_files(
    docs: list[Manifest], workload: Manifest, container: dict[str, Any]
) -> dict[str, tuple[Manifest, dict[str, Any], str]]:
    """Every file a container sees from a Secret volume: path -> (Secret, volume, key)."""
    pod = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", []) if "secret" in v}
    files = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        if volume is None:
            continue
        secret = generated(docs, "Secret", volume["secret"]["secretName"])
        for key in data_keys(secret):
            files[f"{mount['mountPath']}/{key}"] = (secret, volume, key)
    return files


@every_kustomization
def test_every_secret_file_setting_names_a_read_only_secret_mount(
    kustomize: Kustomize, name: str
) -> None:
    docs = kustomize(name)
    checked = 0
    for workload, container in partq_containers(docs):
        where = f"{workload['metadata']['name']}/{container['name']}"
        files = mounted_secret_files(docs, workload, container)
        mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
        for var, value in ((v["name"], v.get("value")) for v in container.get("env", [])):
            if var not in FILE_SETTINGS:
                continue
            checked += 1
            assert value in files, f"{where}: {var}={value} is no file of a mounted Secret"
            _, volume, _ = files[value]
            assert mounts[volume["name"]].get("readOnly") is True, f"{where}: {volume['name']}"
            assert volume["secret"]["defaultMode"] in (0o400, 0o440), f"{where}: {volume['name']}"
        if files:  # group-readable files need the pod's group
            pod_security = workload["spec"]["template"]["spec"]["securityContext"]
            assert pod_security.get("fsGroup") == pod_security["runAsGroup"], where
    assert checked >= 4


def test_the_base_reaches_etcd_and_rabbitmq_over_tls_with_secrets_as_files(
    kustomize: Kustomize,
) -> None:
    docs = kustomize("base")
    daemons = [(w, c) for w, c in partq_containers(docs) if c["args"][0] in DEFAULT_PORTS]
    assert len(daemons) == 2
    for workload, container in daemons:
        env = env_of(container)
        settings = pod_settings(docs, workload, container)
        where = workload["metadata"]["name"]
        assert all(tls for _, _, tls in settings.endpoints), f"{where}: etcd over https://"
        assert settings.amqp.url.startswith("amqps://"), where
        assert settings.etcd_ca is not None and settings.amqp_ca is not None, where
        assert {"PARTQ_ETCD_PASSWORD_FILE", "PARTQ_AMQP_PASSWORD_FILE"} <= set(env), where
        assert settings.etcd_password is not None and settings.http.token is not None, where
        # The HTTP port stays plain: Prometheus scrapes /metrics as before
        assert "--http-cert" not in container["args"] and not settings.http.tls, where


@every_kustomization
def test_each_pods_environment_and_files_make_valid_settings(
    kustomize: Kustomize, name: str
) -> None:
    # What partq reads at start in the pod: a refused combination (a CA with a plain URL,
    # an etcd password over http://, a missing file) would crash-loop every pod.
    docs = kustomize(name)
    for workload, container in partq_containers(docs):
        pod_settings(docs, workload, container)


def pod_settings(docs: list[Manifest], workload: Manifest, container: dict[str, Any]) -> Any:
    """partq.kernel.settings.Settings as the container would build them: its environment, with
    ConfigMap values resolved and each mounted Secret file written under a temporary root."""
    from partq.kernel.settings import Settings  # here: the other deploy tests need no partq

    with tempfile.TemporaryDirectory() as root:
        for path, (secret, _, key) in mounted_secret_files(docs, workload, container).items():
            target = Path(root + path)
            target.parent.mkdir(parents=True, exist_ok=True)
            if key in secret.get("data", {}):
                target.write_bytes(base64.b64decode(secret["data"][key]))
            else:
                target.write_text(secret["stringData"][key])
        environ = {}
        for var in container.get("env", []):
            if "value" in var:
                value = var["value"]
                environ[var["name"]] = root + value if value.startswith("/etc/") else value
            elif "configMapKeyRef" in var.get("valueFrom", {}):
                ref = var["valueFrom"]["configMapKeyRef"]
                environ[var["name"]] = generated(docs, "ConfigMap", ref["name"])["data"][ref["key"]]
        with pytest.MonkeyPatch.context() as patch:
            for variable in [v for v in os.environ if v.startswith("PARTQ_")]:
                patch.delenv(variable)
            for variable, value in environ.items():
                patch.setenv(variable, value)
            return Settings.load()


@every_kustomization
def test_referenced_secrets_and_configmaps_exist_with_their_keys(
    kustomize: Kustomize, name: str
) -> None:
    docs = kustomize(name)
    refs = 0
    for workload in workloads(docs):
        namespace = workload["metadata"].get("namespace")
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for var in container.get("env", []):
                for ref_kind, kind in (
                    ("secretKeyRef", "Secret"),
                    ("configMapKeyRef", "ConfigMap"),
                ):
                    ref = var.get("valueFrom", {}).get(ref_kind)
                    if ref is None:
                        continue
                    refs += 1
                    target = find(docs, kind, ref["name"])
                    assert target["metadata"].get("namespace") == namespace
                    if not ref.get("optional"):
                        assert ref["key"] in data_keys(target), (
                            f"{kind} {ref['name']}: {ref['key']}"
                        )
    assert refs >= 8


@every_kustomization
def test_services_and_budgets_select_pods_and_ports_that_exist(
    kustomize: Kustomize, name: str
) -> None:
    docs = kustomize(name)
    pods = [w["spec"]["template"] for w in workloads(docs)]
    for service in (d for d in docs if d["kind"] == "Service"):
        chosen = [p for p in pods if selects(service["spec"]["selector"], p["metadata"]["labels"])]
        assert chosen, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for pod in chosen:
                named = {p.get("name") for c in pod["spec"]["containers"] for p in c["ports"]}
                assert port["targetPort"] in named, service["metadata"]["name"]
    for budget in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        assert any(selects(selector, p["metadata"]["labels"]) for p in pods)


# ---------------------------------------------------------------- overlays


def test_the_statefulset_overlay_replaces_the_consumer_deployment(kustomize: Kustomize) -> None:
    docs = kustomize("overlays/statefulset")
    assert not [
        d for d in docs if d["kind"] == "Deployment" and "consumers" in d["metadata"]["name"]
    ]
    stateful = find(docs, "StatefulSet", "partq-consumers")
    service = find(docs, "Service", stateful["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert selects(service["spec"]["selector"], stateful["spec"]["template"]["metadata"]["labels"])


def test_the_statefulset_runs_the_same_pods_as_the_base_deployment(kustomize: Kustomize) -> None:
    # The overlay copies the pod template: it must not drift from the base's.
    deployment = find(kustomize("base"), "Deployment", "partq-consumers")
    stateful = find(kustomize("overlays/statefulset"), "StatefulSet", "partq-consumers")
    assert stateful["spec"]["template"] == deployment["spec"]["template"]
    assert stateful["spec"]["selector"] == deployment["spec"]["selector"]


def test_the_dev_overlay_is_self_contained(kustomize: Kustomize) -> None:
    docs = kustomize("overlays/dev")
    find(docs, "Namespace", "partq-dev")
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "partq-dev", doc["metadata"]["name"]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    config = generated(docs, "ConfigMap", "partq-config")["data"]
    secret = generated(docs, "Secret", "partq-credentials")
    assert (
        secret["metadata"]["name"]
        != generated(kustomize("base"), "Secret", "partq-credentials")["metadata"]["name"]
    )
    assert base64.b64decode(secret["data"]["amqp-password"]).decode() == "partq"
    for url in (config["etcd-endpoints"], config["amqp-url"]):
        parts = urlsplit(url)
        assert parts.hostname in services, f"{url}: no Service {parts.hostname} in the overlay"
        ports = {p["port"] for p in services[parts.hostname]["spec"]["ports"]}
        assert parts.port in ports, url
    for _, container in partq_containers(docs):
        assert container["image"] == "partq:dev"


def test_the_base_secret_is_only_a_placeholder(kustomize: Kustomize) -> None:
    docs = kustomize("base")
    for name in ("partq-credentials", "partq-tls"):
        secret = generated(docs, "Secret", name)
        for key, value in secret["data"].items():
            assert base64.b64decode(value).decode() == "CHANGE-ME", f"{name}: {key}"


def test_pod_templates_are_hardened(kustomize: Kustomize) -> None:
    for workload, container in partq_containers(kustomize("base")):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"]["drop"] == ["ALL"]
        assert "memory" in container["resources"]["limits"]


def test_the_keda_query_is_valid_promql(tmp_path: Path, promtool: str) -> None:
    (trigger,) = yaml.safe_load(KEDA.read_text())["spec"]["triggers"]
    rules = {
        "groups": [
            {
                "name": "keda",
                "rules": [{"record": "keda:query", "expr": trigger["metadata"]["query"]}],
            }
        ]
    }
    path = tmp_path / "keda-query.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def dev_hints() -> dict[str, list[str]]:
    """The commands in the dev overlay's header comment, by their first two words."""
    hints: dict[str, list[str]] = {}
    for line in (
        (DEPLOY / "k8s" / "overlays" / "dev" / "kustomization.yaml").read_text().splitlines()
    ):
        if not line.startswith("#   "):
            if hints:
                break  # the header ends at its first line that is not a command
            continue
        words = shlex.split(line[1:], comments=True)
        hints[" ".join(words[:2])] = words
    return hints


def test_the_dev_overlay_s_hints_name_what_exists(kustomize: Kustomize) -> None:
    # Given the commands the dev overlay's header tells a developer to run
    hints = dev_hints()
    docs = kustomize("overlays/dev")
    image = {c["image"] for _, c in partq_containers(docs)}
    # Then the image they build and load is the one the overlay's pods run (and never pull)
    assert hints["docker build"] == ["docker", "build", "-t", "partq:dev", "."]
    assert (REPO / "Dockerfile").is_file()
    assert image == {hints["docker build"][3]}
    assert hints["kind load"] == ["kind", "load", "docker-image", *image]
    for _, container in partq_containers(docs):
        assert container.get("imagePullPolicy", "IfNotPresent") != "Always", container["name"]
    # And `kubectl apply -k` names this overlay, whose Job creates the stream `orders`
    assert (REPO / hints["kubectl apply"][-1]).resolve() == DEPLOY / "k8s" / "overlays" / "dev"
    assert generated(docs, "ConfigMap", "partq-config")["data"]["stream"] == "orders"
    job = next(d for d in docs if d["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["stream", "create"]
    # And the port-forward's namespace, Service and port exist
    forward = hints["kubectl -n"]
    namespace, service, port = forward[2], forward[4].removeprefix("svc/"), int(forward[5])
    assert forward[3] == "port-forward"
    found = find(docs, "Service", service)
    assert found["metadata"]["namespace"] == namespace
    assert port in {p["port"] for p in found["spec"]["ports"]}
    # And the status page's curl sends the overlay's token to that port
    curl = hints["curl -H"]
    token = base64.b64decode(generated(docs, "Secret", "partq-credentials")["data"]["http-token"])
    assert curl[2] == f"Authorization: Bearer {token.decode()}"
    assert urlsplit(curl[3]).port == port

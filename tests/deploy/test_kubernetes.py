"""deploy/k8s: the kustomizations build, validate against Kubernetes' schemas, and hang together.

Everything is offline: `kubectl kustomize` renders, kubernetes-validate ships
the schemas. Custom resources (ServiceMonitor, ScaledObject) have no schema
there and are checked field by field.
"""

from __future__ import annotations

import base64
import importlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import DEPLOY, KUSTOMIZATIONS, Manifest, run

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
SECRET_ENV = {"PARTQ_AMQP_URL", "PARTQ_ETCD_USER", "PARTQ_ETCD_PASSWORD"}
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
def test_credentials_come_from_a_secret(kustomize: Kustomize, name: str) -> None:
    for workload, container in partq_containers(kustomize(name)):
        env = env_of(container)
        assert "PARTQ_AMQP_URL" in env, workload["metadata"]["name"]
        for var in SECRET_ENV & set(env):
            assert "secretKeyRef" in env[var].get("valueFrom", {}), (
                f"{workload['metadata']['name']}: {var} must come from a Secret"
            )
        for var in env.values():
            assert not re.search(r"://[^/\s]*:[^@/\s]*@", var.get("value", "")), var["name"]


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
    amqp = base64.b64decode(secret["data"]["amqp-url"]).decode()
    for url in (config["etcd-endpoints"], amqp):
        parts = urlsplit(url)
        assert parts.hostname in services, f"{url}: no Service {parts.hostname} in the overlay"
        ports = {p["port"] for p in services[parts.hostname]["spec"]["ports"]}
        assert parts.port in ports, url
    for _, container in partq_containers(docs):
        assert container["image"] == "partq:dev"


def test_the_base_secret_is_only_a_placeholder(kustomize: Kustomize) -> None:
    secret = generated(kustomize("base"), "Secret", "partq-credentials")
    amqp = base64.b64decode(secret["data"]["amqp-url"]).decode()
    assert "CHANGE-ME" in amqp


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

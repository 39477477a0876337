"""The Kubernetes manifests (docker/k8s), checked statically against Kubernetes 1.30's schemas.

No cluster is needed: every object is validated with kubernetes-validate (strict: an
unknown field fails), and what the schemas cannot see is checked here: environment
variables that are real settings of the service that reads them, probes on the port the
service serves, names that refer to objects these files define.
"""

import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml
from pydantic_settings import BaseSettings

from bootstrap.settings import BootstrapSettings
from decode_node.settings import DecodeSettings
from prefill_node.settings import PrefillSettings
from shared.settings import SHARED_JOIN_TOKEN

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
KUBERNETES = "1.30"
NAMESPACE = "kvroom"
SETTINGS: dict[str, type[BaseSettings]] = {
    "bootstrap": BootstrapSettings,
    "prefill_node": PrefillSettings,
    "decode_node": DecodeSettings,
}
# What the downward API gives a pod, for building its settings here.
DOWNWARD = {"status.podIP": "10.1.0.7", "status.hostIP": "10.0.0.7", "metadata.name": "pod-0"}
WORKLOADS = ("Deployment", "StatefulSet")


def load_docs() -> dict[str, list[dict[str, Any]]]:
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        for path in sorted(K8S.glob("*.yaml"))
    }


DOCS = load_docs()
OBJECTS = [(name, doc) for name, docs in DOCS.items() for doc in docs if doc.get("kind") != "Kustomization"]


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for _, d in OBJECTS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container that runs a kvroom entry point."""
    found = []
    for _, doc in OBJECTS:
        if doc["kind"] in WORKLOADS:
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c.get("command", [])[:2] == ["python", "-m"]:
                    found.append((doc, c))
    return found


def module_of(container: dict[str, Any]) -> str:
    return str(container["command"][2])


def env_value(workload: dict[str, Any], item: dict[str, Any]) -> str:
    """An env entry's value as the pod would see it, resolved from the objects defined here."""
    if "value" in item:
        return str(item["value"])
    source = item["valueFrom"]
    if "fieldRef" in source:
        path = source["fieldRef"]["fieldPath"]
        return f"{workload['metadata']['name']}-0" if path == "metadata.name" else DOWNWARD[path]
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return str(find("ConfigMap", ref["name"])["data"][ref["key"]])
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return str(find("Secret", ref["name"])["stringData"][ref["key"]])
    raise AssertionError(f"unexpected env source {source}")


def settings_of(workload: dict[str, Any], container: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The container's settings, built from its environment; and the fields it sets."""
    cls = SETTINGS[module_of(container)]
    prefix = cls.model_config["env_prefix"]
    fields: dict[str, Any] = {}
    for item in container["env"]:
        if item["name"] == SHARED_JOIN_TOKEN:
            continue
        fields[item["name"].removeprefix(prefix).lower()] = env_value(workload, item)
    given = dict(fields)
    # device=cuda is checked against the host's GPUs at start-up; its name is checked here.
    if fields.get("device") == "cuda":
        fields["device"] = "cpu"
    return cls(**fields), given


def resolve_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return int(number)


@pytest.mark.parametrize(
    ("name", "doc"), OBJECTS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in OBJECTS]
)
def test_every_object_validates_against_kubernetes_1_30(name, doc):
    # strict: the schemas with additionalProperties false, so a misspelt field fails too.
    assert kubernetes_validate.validate(doc, KUBERNETES, strict=True) == KUBERNETES


def test_kustomization_lists_every_file():
    (kustomization,) = DOCS["kustomization.yaml"]
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed)), "a file listed twice"
    assert set(listed) == set(DOCS) - {"kustomization.yaml"}


def test_every_object_lives_in_the_kvroom_namespace():
    assert find("Namespace", NAMESPACE)
    for _, doc in OBJECTS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]["name"]


def test_kvroom_env_vars_are_real_settings_of_their_service():
    seen = set()
    for workload, container in containers():
        module = module_of(container)
        cls = SETTINGS[module]
        prefix = cls.model_config["env_prefix"]
        names = [item["name"] for item in container["env"]]
        assert len(names) == len(set(names)), f"{module}: a variable set twice"
        for name in names:
            if name == SHARED_JOIN_TOKEN:
                continue
            assert name.startswith(prefix), f"{module}: {name} is not a {prefix} setting"
            field = name.removeprefix(prefix).lower()
            assert field in cls.model_fields, f"{module}: {name} is not a setting"
        # Every value, resolved as the pod would see it, passes the service's own validators.
        settings_of(workload, container)
        seen.add(module)
    assert seen == set(SETTINGS)


def test_every_service_gets_the_join_token_from_the_secret():
    for _, container in containers():
        (item,) = [e for e in container["env"] if e["name"] == SHARED_JOIN_TOKEN]
        assert item["valueFrom"]["secretKeyRef"] == {"name": "kvroom-join-token", "key": "token"}
    secret = find("Secret", "kvroom-join-token")
    assert "token" in secret["stringData"]
    assert "kubectl" in (K8S / "secret.yaml").read_text(), "says how to replace the placeholder"


def test_bootstrap_runs_two_replicas_on_the_redis_store():
    deployment = find("Deployment", "kvroom-bootstrap")
    assert deployment["spec"]["replicas"] == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "bootstrap"]
    settings, given = settings_of(deployment, container)
    assert isinstance(settings, BootstrapSettings)
    store = urlparse(settings.store)
    assert store.scheme == "redis"
    redis = find("Service", store.hostname or "")
    assert store.port in [p["port"] for p in redis["spec"]["ports"]]
    redis_deployment = find("Deployment", "redis")
    redis_labels = redis_deployment["spec"]["template"]["metadata"]["labels"]
    assert redis["spec"]["selector"].items() <= redis_labels.items()
    (server,) = redis_deployment["spec"]["template"]["spec"]["containers"]
    assert server["image"] == "redis:7" and server["args"][-2:] == ["--appendonly", "yes"]
    claim = redis_deployment["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert find("PersistentVolumeClaim", claim)
    # Each replica advertises its own pod IP: nodes send their reports to their own bootstrap.
    (advertise,) = [e for e in container["env"] if e["name"] == "KVROOM_BOOTSTRAP_ADVERTISE_HOST"]
    assert advertise["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert given["host"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.http_port, "zmq": settings.zmq_port} == {"http": 8000, "zmq": 8001}
    assert container["resources"]["requests"]


def test_the_bootstrap_service_serves_port_8000():
    service = find("Service", "kvroom-bootstrap")
    deployment = find("Deployment", "kvroom-bootstrap")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(8000, 8000)]


def test_kvroom_pods_run_as_the_images_user():
    uid = re.search(r"useradd .*--uid (\d+)", (ROOT / "docker" / "Dockerfile").read_text())
    assert uid
    for workload, container in containers():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == int(uid.group(1))
        assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_probes_hit_health_on_the_services_http_port():
    for workload, container in containers():
        settings, _ = settings_of(workload, container)
        http_port = settings.http_port
        kinds = ("startupProbe", "readinessProbe", "livenessProbe")
        probes = {k: container[k] for k in kinds if k in container}
        assert {"readinessProbe", "livenessProbe"} <= set(probes), workload["metadata"]["name"]
        assert "httpGet" in probes["readinessProbe"]
        for kind, probe in probes.items():
            check = probe.get("httpGet") or probe.get("tcpSocket")
            assert check, f"{kind} of {workload['metadata']['name']}"
            assert resolve_port(container, check["port"]) == http_port, kind
            if "httpGet" in probe:
                assert probe["httpGet"]["path"] == "/health", kind


def test_nodes_use_host_networking_and_request_gpus():
    for role, module, http_port, zmq_port in (
        ("prefill", "prefill_node", 8100, 8101),
        ("decode", "decode_node", 8200, 8201),
    ):
        sts = find("StatefulSet", f"kvroom-{role}")
        assert sts["spec"]["replicas"] == 1
        pod = sts["spec"]["template"]["spec"]
        assert pod["hostNetwork"] is True
        assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # cluster DNS for the bootstrap's name
        (container,) = pod["containers"]
        assert container["command"] == ["python", "-m", module]
        settings, given = settings_of(sts, container)
        assert (settings.http_port, settings.zmq_port) == (http_port, zmq_port)
        assert given["device"] == "cuda" and given["host"] == "0.0.0.0"
        env = {e["name"]: e for e in container["env"]}
        prefix = f"KVROOM_{role.upper()}_"
        assert env[prefix + "NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env[prefix + "ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
        for field, key in (("TRANSPORT", "transport"), ("MODEL", "model"), ("DTYPE", "dtype")):
            ref = env[prefix + field]["valueFrom"]["configMapKeyRef"]
            assert ref == {"name": "kvroom-config", "key": key}
        assert find("ConfigMap", "kvroom-config")["data"]["transport"] == "rdma"
        # The bootstrap's Service, in this namespace, on the port it serves.
        url = urlparse(settings.bootstrap_url)
        assert url.hostname == f"kvroom-bootstrap.{NAMESPACE}.svc" and url.port == 8000
        # One GPU a rank.
        resources = container["resources"]
        gpus = settings.tp_size
        assert resources["limits"]["nvidia.com/gpu"] == gpus
        assert resources["requests"]["nvidia.com/gpu"] == gpus
        # With host networking container ports are host ports; declared, so they never collide.
        assert all(p["hostPort"] == p["containerPort"] for p in container["ports"])
        assert {p["containerPort"] for p in container["ports"]} == {http_port, zmq_port}
        # The governing headless Service exists.
        service = find("Service", sts["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"


def test_nodes_drain_before_they_are_killed():
    for role in ("prefill", "decode"):
        sts = find("StatefulSet", f"kvroom-{role}")
        pod = sts["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        settings, _ = settings_of(sts, container)
        grace = settings.drain_grace_s
        assert pod["terminationGracePeriodSeconds"] > grace + 10, "time for the last reports and leave"
        # 503 while draining must not count as dead before the drain could finish.
        liveness = container["livenessProbe"]
        if "httpGet" in liveness:
            assert liveness["failureThreshold"] * liveness["periodSeconds"] > 2 * grace


def test_nodes_get_memlock_shm_and_the_models_volume():
    claim = find("PersistentVolumeClaim", "kvroom-models")
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    for role in ("prefill", "decode"):
        pod = find("StatefulSet", f"kvroom-{role}")["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]["name"]]
        assert shm["emptyDir"]["medium"] == "Memory"
        models = mounts["/models"]
        assert models["readOnly"] is True
        assert volumes[models["name"]]["persistentVolumeClaim"]["claimName"] == "kvroom-models"


def test_references_resolve_to_objects_defined_here():
    for _, doc in OBJECTS:
        if doc["kind"] not in WORKLOADS:
            continue
        spec = doc["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        for volume in spec["template"]["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert find("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    for _, doc in OBJECTS:
        if doc["kind"] == "Service":
            selector = doc["spec"]["selector"].items()
            assert any(
                selector <= w["spec"]["template"]["metadata"]["labels"].items()
                for _, w in OBJECTS
                if w["kind"] in WORKLOADS
            ), f"Service {doc['metadata']['name']} selects no pod"


@pytest.mark.parametrize(
    ("token", "starts"), [("REPLACE-ME-with-openssl-rand-hex-24", False), ("", False), ("3f9c0d5e1a", True)]
)
def test_the_bootstrap_refuses_the_placeholder_secret(token, starts):
    pod = find("Deployment", "kvroom-bootstrap")["spec"]["template"]["spec"]
    (check,) = pod["initContainers"]
    assert check["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "kvroom-join-token", "key": "token"}
    assert find("Secret", "kvroom-join-token")["stringData"]["token"].startswith("REPLACE-ME")
    out = subprocess.run(check["command"], env={"KVROOM_JOIN_TOKEN": token}, capture_output=True, timeout=10)
    assert (out.returncode == 0) is starts, out.stderr

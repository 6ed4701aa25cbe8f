"""``deploy/kubernetes/``: every manifest valid for Kubernetes 1.30 (offline, strict: an
unknown field fails), and consistent with the code that drives it: the Deployments are named
as ``planner.kubernetes`` computes, the planner's Role grants what the actuator calls, the
workers are configured as ``tandem up`` launches them and the gateway's settings exist."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from core.messages import WorkerRole
from gateway.assembly.settings import TandemSettings
from kv_transfer.connector import ConnectorConfig, kv_transfer_config
from planner.actuate import PoolName
from planner.kubernetes import REASON_ANNOTATION, deployment_name, version_slug

KUBERNETES_VERSION = "1.30"
MANIFESTS = Path(__file__).parents[2] / "deploy" / "kubernetes"
POOLS: dict[PoolName, WorkerRole] = {"prefill": WorkerRole.PREFILL, "decode": WorkerRole.DECODE}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((f"{path.name}: {doc['kind']} {doc['metadata']['name']}", doc))
    return found


DOCUMENTS = _documents()


def _one(kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for _, d in DOCUMENTS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _args(container: dict[str, Any]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"] if "=" in arg)


GATEWAY = _one("Deployment", "tandem-gateway")["spec"]["template"]["spec"]
VERSION = _env(GATEWAY["containers"][0])["TANDEM_MODEL_VERSION"]


def test_the_manifests_are_there() -> None:
    kinds = sorted(d["kind"] for _, d in DOCUMENTS)
    assert kinds == sorted(
        ["Namespace", "ServiceAccount", "Role", "RoleBinding"]
        + ["Deployment", "Service"] * 3  # prefill, decode, gateway
    )


@pytest.mark.parametrize(("where", "doc"), DOCUMENTS, ids=[where for where, _ in DOCUMENTS])
def test_valid_for_kubernetes_strictly(where: str, doc: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        pytest.fail(f"{where}: {error}")


def test_every_object_is_labelled_and_namespaced() -> None:
    for where, doc in DOCUMENTS:
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "tandem", where
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "tandem", where


@pytest.mark.parametrize("pool", POOLS)
def test_pools_are_named_as_the_actuator_computes(pool: PoolName) -> None:
    name = deployment_name(VERSION, pool)
    labels = {
        "app.kubernetes.io/name": "tandem",
        "tandem.dev/version": version_slug(VERSION),
        "tandem.dev/pool": pool,
    }
    deployment = _one("Deployment", name)
    assert deployment["metadata"]["annotations"]["tandem.dev/version-name"] == VERSION
    assert REASON_ANNOTATION not in deployment["metadata"]["annotations"]  # the planner's to set
    spec = deployment["spec"]
    assert spec["selector"]["matchLabels"] == labels
    assert labels.items() <= spec["template"]["metadata"]["labels"].items()
    assert labels.items() <= deployment["metadata"]["labels"].items()
    service = _one("Service", name)
    assert service["spec"]["selector"] == labels
    [port] = service["spec"]["ports"]
    assert _env(GATEWAY["containers"][0])[f"TANDEM_{pool.upper()}_URLS"] == (
        f"http://{name}:{port['port']}"
    )


@pytest.mark.parametrize(("pool", "role"), POOLS.items())
def test_workers_run_as_tandem_launches_them(pool: PoolName, role: WorkerRole) -> None:
    deployment = _one("Deployment", deployment_name(VERSION, pool))
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    args = _args(container)
    assert json.loads(args["kv-transfer-config"]) == kv_transfer_config(role, ConnectorConfig())
    assert args["served-model-name"] == VERSION
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(args["port"]) == ports["http"]
    env = _env(container)
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ports["nixl"]
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    block_size = int(_env(GATEWAY["containers"][0])["TANDEM_KV_BLOCK_SIZE"])
    assert int(args["block-size"]) == block_size


def test_gateway_settings_exist() -> None:
    fields = {f"TANDEM_{name.upper()}" for name in TandemSettings.model_fields}
    env = _env(GATEWAY["containers"][0])
    assert set(env) <= fields, set(env) - fields
    assert env["TANDEM_NUM_PREFILL_WORKERS"] == env["TANDEM_NUM_DECODE_WORKERS"] == "0"
    assert GATEWAY["containers"][0]["command"] == ["tandem", "up"]


def test_planner_may_get_and_patch_deployments_and_their_scale_only() -> None:
    [rule] = _one("Role", "tandem-planner")["rules"]
    assert rule == {
        "apiGroups": ["apps"],
        "resources": ["deployments", "deployments/scale"],
        "verbs": ["get", "patch"],
    }
    binding = _one("RoleBinding", "tandem-planner")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "tandem-planner",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "tandem-planner", "namespace": "tandem"}
    ]
    assert GATEWAY["serviceAccountName"] == "tandem-planner"


def test_the_validator_refuses_an_unknown_field() -> None:
    """Strictness is what makes the check worth having: a misspelt field must fail."""
    deployment = _one("Deployment", "tandem-gateway")
    assert kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True) == "1.30"
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)

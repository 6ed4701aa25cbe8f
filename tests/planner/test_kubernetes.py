"""The Kubernetes actuator against a local server speaking the API's Deployment contract.

No cluster: ``FakeApiServer`` serves ``/apis/apps/v1/namespaces/{ns}/deployments/{name}`` and
its ``/scale`` subresource over real HTTP with in-memory Deployments, the JSON Kubernetes
returns (``Scale`` of ``autoscaling/v1``, ``Deployment`` of ``apps/v1``, a ``Status`` for a
404), and the patch content types the API server accepts (415 for others). The official
client is pointed at it, unmocked.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from kubernetes import client

from planner.actuate import ActuatorError
from planner.kubernetes import (
    REASON_ANNOTATION,
    KubernetesActuator,
    KubernetesConfig,
    deployment_name,
    version_slug,
)
from planner.loop import PoolState

VERSION = "smollm2-135m-instruct@2b8df5d2"
NAMESPACE = "tandem"
PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


@dataclass
class FakeDeployment:
    replicas: int
    ready: int = 0
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    content_type: str
    body: Any


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386 merge (what both merge patches do to these fields)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


class FakeApiServer:
    def __init__(self) -> None:
        self.deployments: dict[tuple[str, str], FakeDeployment] = {}
        self.seen: list[Seen] = []
        app = web.Application()
        base = "/apis/apps/v1/namespaces/{ns}/deployments/{name}"
        app.router.add_route("GET", base, self._deployment)
        app.router.add_route("PATCH", base, self._deployment)
        app.router.add_route("GET", base + "/scale", self._scale)
        app.router.add_route("PATCH", base + "/scale", self._scale)
        self._runner = web.AppRunner(app)
        self.url = ""

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def aclose(self) -> None:
        await self._runner.cleanup()

    async def _find(self, request: web.Request) -> tuple[str, str, FakeDeployment | None]:
        ns, name = request.match_info["ns"], request.match_info["name"]
        body = await request.json() if request.can_read_body else None
        self.seen.append(
            Seen(request.method, request.path, request.headers.get("Content-Type", ""), body)
        )
        return ns, name, self.deployments.get((ns, name))

    async def _scale(self, request: web.Request) -> web.Response:
        ns, name, found = await self._find(request)
        if found is None:
            return _not_found(name)
        if request.method == "PATCH":
            if (refused := _check_patch(request)) is not None:
                return refused
            scale = {"spec": {"replicas": found.replicas}}
            _merge(scale, self.seen[-1].body)
            found.replicas = int(scale["spec"]["replicas"])
        return web.json_response(
            {
                "kind": "Scale",
                "apiVersion": "autoscaling/v1",
                "metadata": _metadata(ns, name, {}),
                "spec": {"replicas": found.replicas},
                "status": {"replicas": found.ready, "selector": _selector(name)},
            }
        )

    async def _deployment(self, request: web.Request) -> web.Response:
        ns, name, found = await self._find(request)
        if found is None:
            return _not_found(name)
        if request.method == "PATCH":
            if (refused := _check_patch(request)) is not None:
                return refused
            patch = self.seen[-1].body
            if set(patch) != {"metadata"}:
                return web.json_response({"message": "test server: metadata only"}, status=422)
            metadata: dict[str, Any] = {"annotations": dict(found.annotations)}
            _merge(metadata, patch["metadata"])
            found.annotations = metadata["annotations"]
        labels = {"app.kubernetes.io/name": "tandem", "tandem.dev/deployment": name}
        status: dict[str, Any] = {"replicas": found.replicas, "observedGeneration": 1}
        if found.ready:  # Kubernetes leaves readyReplicas out when it is 0
            status["readyReplicas"] = found.ready
        return web.json_response(
            {
                "kind": "Deployment",
                "apiVersion": "apps/v1",
                "metadata": _metadata(ns, name, found.annotations),
                "spec": {
                    "replicas": found.replicas,
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
                    },
                },
                "status": status,
            }
        )


def _check_patch(request: web.Request) -> web.Response | None:
    if request.headers.get("Content-Type") in PATCH_TYPES:
        return None
    return _status(415, "UnsupportedMediaType", "the body of the request was in an unknown format")


def _metadata(ns: str, name: str, annotations: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ns,
        "uid": "00000000-0000-0000-0000-000000000001",
        "resourceVersion": "1",
        "creationTimestamp": "2025-01-01T00:00:00Z",
        "annotations": annotations,
    }


def _selector(name: str) -> str:
    return f"app.kubernetes.io/name=tandem,tandem.dev/deployment={name}"


def _not_found(name: str) -> web.Response:
    return _status(404, "NotFound", f'deployments.apps "{name}" not found')


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return web.Response(text=json.dumps(body), status=code, content_type="application/json")


def _actuator(url: str) -> KubernetesActuator:
    configuration = client.Configuration(host=url)
    configuration.retries = 0  # an unreachable server fails at once, not after urllib3's retries
    return KubernetesActuator(
        client.ApiClient(configuration),
        KubernetesConfig(namespace=NAMESPACE, request_timeout_s=5),
    )


@pytest.fixture
async def server() -> AsyncIterator[FakeApiServer]:
    fake = FakeApiServer()
    await fake.start()
    yield fake
    await fake.aclose()


@pytest.fixture
async def actuator(server: FakeApiServer) -> AsyncIterator[KubernetesActuator]:
    built = _actuator(server.url)
    yield built
    await built.aclose()


def _add(server: FakeApiServer, pool: str, replicas: int, ready: int = 0) -> FakeDeployment:
    deployment = FakeDeployment(replicas, ready)
    server.deployments[NAMESPACE, f"tandem-smollm2-135m-instruct-2b8df5d2-{pool}"] = deployment
    return deployment


async def test_scale_up_and_down_patches_the_scale_subresource(
    server: FakeApiServer, actuator: KubernetesActuator
) -> None:
    prefill = _add(server, "prefill", 1, ready=1)
    decode = _add(server, "decode", 2, ready=2)

    await actuator.scale(VERSION, "prefill", 3, "prefill backlog over target")
    assert (prefill.replicas, decode.replicas) == (3, 2)
    await actuator.scale(VERSION, "prefill", 0, "no traffic")
    assert prefill.replicas == 0

    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/tandem-smollm2-135m-instruct-2b8df5d2-prefill"
    patches = [seen for seen in server.seen if seen.method == "PATCH"]
    assert [(p.path, p.content_type, p.body) for p in patches] == [
        (path + "/scale", "application/merge-patch+json", {"spec": {"replicas": 3}}),
        (
            path,
            "application/merge-patch+json",
            {"metadata": {"annotations": {REASON_ANNOTATION: "prefill backlog over target"}}},
        ),
        (path + "/scale", "application/merge-patch+json", {"spec": {"replicas": 0}}),
        (
            path,
            "application/merge-patch+json",
            {"metadata": {"annotations": {REASON_ANNOTATION: "no traffic"}}},
        ),
    ]
    assert prefill.annotations == {REASON_ANNOTATION: "no traffic"}


async def test_state_counts_ready_and_starting(
    server: FakeApiServer, actuator: KubernetesActuator
) -> None:
    _add(server, "prefill", 3, ready=1)
    _add(server, "decode", 0)
    assert await actuator.state(VERSION, "prefill") == PoolState(ready=1, starting=2)
    assert await actuator.state(VERSION, "decode") == PoolState(ready=0, starting=0)

    await actuator.scale(VERSION, "decode", 2, "decode concurrency over target")
    assert await actuator.state(VERSION, "decode") == PoolState(ready=0, starting=2)


async def test_state_while_scaling_down_has_nothing_starting(
    server: FakeApiServer, actuator: KubernetesActuator
) -> None:
    _add(server, "decode", 1, ready=3)  # pods still terminating: more ready than asked for
    assert await actuator.state(VERSION, "decode") == PoolState(ready=3, starting=0)


async def test_unknown_deployment_is_an_actuator_error_naming_it(
    actuator: KubernetesActuator,
) -> None:
    name = "tandem-smollm2-135m-instruct-2b8df5d2-decode"
    with pytest.raises(ActuatorError, match=rf"'{name}' in namespace 'tandem'.*HTTP 404"):
        await actuator.scale(VERSION, "decode", 2, "up")
    with pytest.raises(ActuatorError, match=rf"'{name}' in namespace 'tandem'.*HTTP 404"):
        await actuator.state(VERSION, "decode")


async def test_unreachable_api_server_is_an_actuator_error() -> None:
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    actuator = _actuator(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(ActuatorError, match=r"unreachable.*'tandem-smollm2"):
            await actuator.state(VERSION, "prefill")
        with pytest.raises(ActuatorError, match="unreachable"):
            await actuator.scale(VERSION, "prefill", 1, "up")
    finally:
        await actuator.aclose()


async def test_negative_replicas_are_refused_before_any_request(
    server: FakeApiServer, actuator: KubernetesActuator
) -> None:
    _add(server, "prefill", 1)
    with pytest.raises(ValueError, match="at least 0"):
        await actuator.scale(VERSION, "prefill", -1, "bug")
    assert server.seen == []


def test_from_environment_without_credentials_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ActuatorError, match=r"no Kubernetes credentials.*KUBECONFIG"):
        KubernetesActuator.from_environment(KubernetesConfig(kubeconfig=str(tmp_path / "none")))


def test_from_environment_reads_the_kubeconfig(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    actuator = KubernetesActuator.from_environment(KubernetesConfig(kubeconfig=str(kubeconfig)))
    assert actuator._api_client.configuration.host == "http://127.0.0.1:1"


@pytest.mark.parametrize(
    ("version", "slug"),
    [
        ("smollm2-135m-instruct@2b8df5d2", "smollm2-135m-instruct-2b8df5d2"),
        ("Qwen/Qwen2.5-0.5B_Instruct@ABC", "qwen-qwen2-5-0-5b-instruct-abc"),
        ("--a@@b--", "a-b"),
        ("llama", "llama"),
    ],
)
def test_slug_is_a_dns_label(version: str, slug: str) -> None:
    assert version_slug(version) == slug
    assert deployment_name(version, "decode") == f"tandem-{slug}-decode"


def test_long_and_empty_slugs_keep_a_hash_and_the_limit() -> None:
    label = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
    one, two = "x" * 60 + "@aaaa", "x" * 60 + "@bbbb"
    for version in (one, two, "@@@", "é"):
        assert len(version_slug(version)) <= 48
        assert len(deployment_name(version, "prefill")) <= 63
        assert re.match(label, version_slug(version))
    assert version_slug(one) != version_slug(two)
    assert version_slug("@@@").startswith("v-")

"""The Kubernetes actuator: a version's pools are two Deployments, scaled by their ``scale``.

Naming (``deploy/kubernetes/`` follows it): the version ``smollm2-135m-instruct@2b8df5d2``
runs as the Deployments ``tandem-smollm2-135m-instruct-2b8df5d2-prefill`` and ``-decode`` in
the configured namespace, labelled ``tandem.dev/version: <slug>`` and ``tandem.dev/pool``.
The slug (``version_slug``) is the version made a DNS-1123 label: lowercased, every character
outside ``[a-z0-9-]`` (``@``, ``.``, ``_``, ``/``) replaced by ``-``, runs of ``-`` collapsed,
``-`` trimmed from both ends; one longer than 48 characters (so that the Deployment's and its
Service's names stay within 63) is cut to 39 and ends with ``-`` and 8 hex digits of the
version's SHA-256, so two long versions sharing a prefix do not collide.

``scale`` merge-patches the Deployment's ``scale`` subresource, then writes the planner's
reason on the Deployment as the annotation ``tandem.dev/planner-reason`` (``kubectl describe``
shows why the pool has its size). ``state`` reads the Deployment: ``ready`` is
``status.readyReplicas``, ``starting`` the replicas asked for and not ready yet.

The official client is synchronous: every call runs on a worker thread. Every refusal
(``ApiException``: HTTP status and reason) and every unreachable API server (urllib3's errors,
``OSError``) becomes ``ActuatorError`` naming the Deployment and the namespace.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import urllib3
from kubernetes import client, config

from planner.actuate import ActuatorError, PoolName
from planner.loop import PoolState

log = logging.getLogger("tandem.planner")

REASON_ANNOTATION = "tandem.dev/planner-reason"
"""Annotation on a Deployment holding the planner's last reason for its size."""
MAX_SLUG_CHARS = 48
"""``tandem-`` + slug + ``-prefill`` stays a 63-character DNS-1123 label."""
_MAX_ANNOTATION_CHARS = 1024
_HASH_CHARS = 8
_INVALID = re.compile(r"[^a-z0-9-]+")
_DASHES = re.compile(r"-{2,}")

T = TypeVar("T")


def version_slug(version: str) -> str:
    """The version as a DNS-1123 label of at most ``MAX_SLUG_CHARS`` characters."""
    slug = _DASHES.sub("-", _INVALID.sub("-", version.lower())).strip("-")
    if slug and len(slug) <= MAX_SLUG_CHARS:
        return slug
    digest = hashlib.sha256(version.encode()).hexdigest()[:_HASH_CHARS]
    head = slug[: MAX_SLUG_CHARS - _HASH_CHARS - 1].rstrip("-")
    return f"{head}-{digest}" if head else f"v-{digest}"


def deployment_name(version: str, pool: PoolName) -> str:
    """The Deployment running ``pool`` of ``version``: ``tandem-<slug>-<pool>``."""
    return f"tandem-{version_slug(version)}-{pool}"


@dataclass(frozen=True, slots=True)
class KubernetesConfig:
    namespace: str = "default"
    """Namespace of the versions' Deployments (the planner's Role is granted there)."""
    request_timeout_s: float = 10.0
    """Longest wait for one API call before the pool counts as unreachable this step."""
    kubeconfig: str | None = None
    """Kubeconfig file used outside a cluster; None = ``$KUBECONFIG`` or ``~/.kube/config``."""


class KubernetesActuator:
    """Scales a version's prefill and decode Deployments through the Kubernetes API."""

    def __init__(self, api_client: client.ApiClient, settings: KubernetesConfig) -> None:
        self._api_client = api_client
        self._apps = client.AppsV1Api(api_client)
        self._settings = settings

    @classmethod
    def from_environment(cls, settings: KubernetesConfig) -> KubernetesActuator:
        """Credentials of the pod's service account in a cluster, else the kubeconfig
        (``$KUBECONFIG`` or ``~/.kube/config``, its current context)."""
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except config.ConfigException as in_cluster:
            try:
                config.load_kube_config(  # type: ignore[no-untyped-call]
                    settings.kubeconfig, client_configuration=configuration
                )
            except (config.ConfigException, OSError) as kubeconfig:
                raise ActuatorError(
                    "no Kubernetes credentials: not in a cluster "
                    f"({in_cluster}) and no usable kubeconfig ({kubeconfig}); run the planner "
                    "in a pod with its service account, or set KUBECONFIG"
                ) from kubeconfig
        return cls(client.ApiClient(configuration), settings)

    async def aclose(self) -> None:
        """Close the client's connection pool."""
        await asyncio.to_thread(self._api_client.close)

    async def state(self, version: str, pool: PoolName) -> PoolState:
        """The Deployment's ready replicas, and those asked for that are not ready yet."""
        name = deployment_name(version, pool)
        deployment = await self._call(
            name,
            "read",
            lambda: self._apps.read_namespaced_deployment(
                name, self._settings.namespace, _request_timeout=self._settings.request_timeout_s
            ),
        )
        wanted = (deployment.spec.replicas if deployment.spec else None) or 0
        ready = (deployment.status.ready_replicas if deployment.status else None) or 0
        return PoolState(ready=ready, starting=max(wanted - ready, 0))

    async def scale(self, version: str, pool: PoolName, replicas: int, reason: str) -> None:
        """Set the Deployment's replicas through its ``scale``, then record ``reason`` on it."""
        if replicas < 0:
            raise ValueError(f"replicas must be at least 0, not {replicas}")
        name = deployment_name(version, pool)
        namespace = self._settings.namespace
        timeout = self._settings.request_timeout_s
        # A merge patch, not the client's default pick: only spec.replicas changes, and the
        # same body means the same thing to every API server version.
        await self._call(
            name,
            "scale",
            lambda: self._apps.patch_namespaced_deployment_scale(
                name,
                namespace,
                {"spec": {"replicas": replicas}},
                _request_timeout=timeout,
                _content_type="application/merge-patch+json",
            ),
        )
        # After the scale: an annotation naming a size the Deployment never got would lie.
        # Metadata only, so no rollout starts.
        annotation = {
            "metadata": {"annotations": {REASON_ANNOTATION: reason[:_MAX_ANNOTATION_CHARS]}}
        }
        await self._call(
            name,
            "annotate",
            lambda: self._apps.patch_namespaced_deployment(
                name,
                namespace,
                annotation,
                _request_timeout=timeout,
                _content_type="application/merge-patch+json",
            ),
        )
        log.info("planner: %s/%s -> %d replicas: %s", namespace, name, replicas, reason)

    async def _call(self, name: str, action: str, call: Callable[[], T]) -> T:
        where = f"Deployment {name!r} in namespace {self._settings.namespace!r}"
        try:
            return await asyncio.to_thread(call)
        except client.ApiException as error:
            raise ActuatorError(
                f"Kubernetes refused to {action} {where}: HTTP {error.status} {error.reason}"
            ) from error
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise ActuatorError(
                f"Kubernetes API server unreachable ({action} {where}): {error}"
            ) from error

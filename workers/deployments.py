"""The model versions this gateway serves, each on workers of its own.

A ``Deployment`` is one version with its prefill and decode pools: KV moves only between the
workers of one deployment (routing picks both from it), since a version's KV means nothing to
another's weights. ``Deployments`` is the live set, in the order they were deployed, changed at
runtime by deploy and undeploy; ``Deployments.pool(role)`` is every deployment's workers of one
role as one ``WorkerSource``, for what watches all workers (admission capacity, the KV-usage
poll, metrics, telemetry).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from core.messages import WorkerRole
from core.models import ServedModel
from workers.registry import Worker, WorkerSource, least_loaded


@dataclass(frozen=True, slots=True)
class Deployment:
    """One version and the workers serving it."""

    model: ServedModel
    prefill: WorkerSource
    decode: WorkerSource

    @property
    def version(self) -> str:
        """The version's name (``<alias>@<8 hex>``; the alias for an unregistered model)."""
        return self.model.version_name

    @property
    def healthy(self) -> bool:
        """A request could be served now: a decode worker in rotation, and a prefill worker in
        rotation when it has prefill workers that are not leaving (a prefill pool scaled to
        zero serves colocated)."""
        decode_ok = any(worker.in_rotation for worker in self.decode.workers)
        prefill = [worker for worker in self.prefill.workers if not worker.draining]
        return decode_ok and (not prefill or any(worker.healthy for worker in prefill))

    @property
    def workers(self) -> tuple[Worker, ...]:
        return (*self.prefill.workers, *self.decode.workers)


class DeploymentExistsError(Exception):
    """That version is already deployed on this gateway."""


class Deployments:
    """The live deployments by version name, in deployment order (the first of an alias is
    what the alias serves while no traffic policy names its versions)."""

    def __init__(self, deployments: Sequence[Deployment] = ()) -> None:
        self._by_version: dict[str, Deployment] = {}
        for deployment in deployments:
            self.add(deployment)

    def add(self, deployment: Deployment) -> None:
        """Serve one more version; ``DeploymentExistsError`` if it is served already."""
        if deployment.version in self._by_version:
            raise DeploymentExistsError(f"{deployment.version} is already deployed")
        names = {worker.name for worker in self.workers()}
        clash = sorted(names & {worker.name for worker in deployment.workers})
        if clash:
            raise ValueError(f"worker names {clash} are taken by another deployment")
        self._by_version[deployment.version] = deployment

    def remove(self, version: str) -> Deployment | None:
        """Stop routing to ``version``; its workers are the caller's to drain and stop."""
        return self._by_version.pop(version, None)

    def get(self, version: str) -> Deployment | None:
        return self._by_version.get(version)

    def of_alias(self, alias: str) -> list[Deployment]:
        """The deployments of ``alias``'s versions, in deployment order."""
        return [d for d in self._by_version.values() if d.model.name == alias]

    def aliases(self) -> list[str]:
        """Every alias served, in order of first deployment."""
        return list(dict.fromkeys(d.model.name for d in self._by_version.values()))

    def __iter__(self) -> Iterator[Deployment]:
        return iter(list(self._by_version.values()))

    def __len__(self) -> int:
        return len(self._by_version)

    def workers(self, role: WorkerRole | None = None) -> list[Worker]:
        """Every deployment's workers (of one role)."""
        found: list[Worker] = []
        for deployment in self._by_version.values():
            if role in (None, WorkerRole.PREFILL):
                found.extend(deployment.prefill.workers)
            if role in (None, WorkerRole.DECODE):
                found.extend(deployment.decode.workers)
        return found

    def pool(self, role: WorkerRole) -> WorkerSource:
        """Every deployment's workers of ``role``, read afresh on each access."""
        return _AllWorkers(self, role)


class _AllWorkers:
    """``WorkerSource`` over all deployments' pools of one role."""

    def __init__(self, deployments: Deployments, role: WorkerRole) -> None:
        self._deployments = deployments
        self._role = role

    @property
    def workers(self) -> Sequence[Worker]:
        return self._deployments.workers(self._role)

    @property
    def kv_watermark(self) -> float:
        for deployment in self._deployments:
            pool = deployment.decode if self._role is WorkerRole.DECODE else deployment.prefill
            return pool.kv_watermark
        return 1.0

    def pick(self) -> Worker | None:
        return least_loaded(self.workers, self.kv_watermark)

"""Changes that span this gateway's catalog, its deployer and the version store: undeploying a
version (the admin API's and a finished rollout's), and what the rollout controller changes
(``rollouts.controller.TrafficControl``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway.audited import audit, deployment_json, set_policy
from gateway.catalog import Catalog, Deployer
from traffic.policy import policy_from_dict, policy_to_dict
from versions.store import VersionStore
from workers.deployments import Deployment

DRAIN_TIMEOUT_S = 120.0
"""How long an undeploy waits for the version's requests in flight before stopping workers."""


async def undeploy(
    store: VersionStore,
    catalog: Catalog,
    deployer: Deployer,
    deployment: Deployment,
    *,
    actor: str,
    reason: str,
) -> None:
    """Stop routing to ``deployment`` here, wait (bounded) for its requests in flight, stop its
    workers. The caller checked that no traffic policy names it."""
    catalog.deployments.remove(deployment.version)
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    # Polled: a worker's count has no event to wait on, and undeploying is rare.
    while any(w.num_outstanding for w in deployment.workers) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.2)
    await deployer.undeploy(deployment)
    await audit(
        store,
        "deployment.delete",
        actor=actor,
        alias=deployment.model.name,
        subject=deployment.version,
        before=deployment_json(deployment),
        after=None,
        reason=reason,
    )


class GatewayTraffic:
    """``TrafficControl`` over the version store, the catalog and the deployer."""

    def __init__(self, store: VersionStore, catalog: Catalog, deployer: Deployer | None) -> None:
        self._store = store
        self._catalog = catalog
        self._deployer = deployer

    async def policy(self, alias: str) -> dict[str, Any] | None:
        return await self._store.get_policy(alias)

    async def put_policy(
        self, alias: str, policy: dict[str, Any], *, actor: str, reason: str
    ) -> None:
        """Parsed (a malformed policy is a bug, raised as ``PolicyError``), not checked for
        healthy workers: a rollback must go through while a baseline worker restarts."""
        canonical = policy_to_dict(policy_from_dict(alias, policy))
        await set_policy(self._store, alias, canonical, actor=actor, reason=reason)
        # In force here at once; the other replicas within their refresh interval.
        await self._catalog.refresh()

    async def drain(self, version: str, *, actor: str, reason: str) -> None:
        deployment = self._catalog.deployments.get(version)
        if deployment is None or self._deployer is None:
            return
        await undeploy(
            self._store, self._catalog, self._deployer, deployment, actor=actor, reason=reason
        )

    async def audit(
        self,
        action: str,
        *,
        alias: str,
        subject: str,
        after: dict[str, Any],
        actor: str,
        reason: str,
    ) -> None:
        await audit(
            self._store,
            action,
            actor=actor,
            alias=alias,
            subject=subject,
            before=None,
            after=after,
            reason=reason,
        )

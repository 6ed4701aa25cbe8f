"""Which version serves a request: the live deployments and the traffic policies over them.

Policies live in the version store (SQLite or Redis) and are set through the admin API on any
replica. Every replica keeps a compiled copy (``traffic.Resolver``) and polls the store's policy
revision every ``refresh_interval_s`` (one cheap read), reloading the whole table when it moved:
a policy set on one replica is in force on all of them within about that interval. Resolution
itself reads only that in-memory table: no I/O on the request path.

What a request's ``model`` may name:
  an alias with a policy     -> the policy (pin > sticky or weighted; shadow on top)
  an alias without a policy  -> its first deployed version
  a version (``alias@8hex``) -> that version, unless the alias's policy closed direct access
                                (a tenant pinned to the version may still name it)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Annotated, Protocol

from pydantic import AfterValidator

from admission.quota import StoreUnavailable
from core.errors import ModelNotFoundError, NoHealthyWorkerError
from core.http1 import worker_url
from core.models import GenerationDefaults
from traffic.policy import PolicyError, TrafficPolicy, policy_from_dict
from traffic.resolver import Resolver, Subject, resolve, resolve_direct
from versions.records import ModelVersion
from versions.store import VersionStore
from workers.deployments import Deployment, Deployments

log = logging.getLogger("tandem.gateway")

_UNDEPLOYED_RETRY_AFTER_S = 2.0


@dataclass(frozen=True, slots=True)
class Resolved:
    """The version chosen for a request, and the one it is shadowed to (if any)."""

    deployment: Deployment
    reason: str
    """``pin``, ``sticky``, ``weighted``, ``only`` or ``direct`` (traffic.resolver)."""
    shadow: Deployment | None = None
    shadow_max_in_flight: int = 0
    """The policy's cap on shadow copies in flight to ``shadow``."""


WorkerUrl = Annotated[str, AfterValidator(worker_url)]
"""An external worker's base URL wherever one is configured (settings, the stack file, the admin
API): trimmed, or refused with ``worker_url``'s message saying what is accepted."""


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """The workers a version is deployed on."""

    num_prefill: int = 0
    num_decode: int = 1
    prefill_urls: tuple[str, ...] = ()
    """Prefill workers someone else runs (a GPU host elsewhere)."""
    decode_urls: tuple[str, ...] = ()
    served_as: str | None = None
    """The model name external workers serve; managed ones serve the version's name."""
    engine_args: tuple[str, ...] = ()
    """vLLM flags for its managed workers that do not change outputs (``--max-num-seqs 4``):
    how it runs, not what it is. Flags that change outputs belong to the version."""


class Deployer(Protocol):
    """Starts and stops versions' workers at runtime (``tandem up``'s supervisor)."""

    async def deploy(self, version: ModelVersion, spec: DeploymentSpec) -> Deployment:
        """Launch (or reach) its workers and wait until they are healthy; the caller adds
        the deployment to the catalog. Raises ``DeployError`` saying why it could not."""
        ...

    async def undeploy(self, deployment: Deployment) -> None:
        """Stop its managed workers (the caller removed it from routing and drained it)."""
        ...


class VersionBuilder(Protocol):
    """Turns a model source into a version record (``tandem model register``)."""

    async def build(
        self,
        source: str,
        alias: str,
        *,
        dtype: str | None,
        defaults: GenerationDefaults,
        engine_args: tuple[str, ...],
        note: str,
        actor: str,
    ) -> ModelVersion:
        """Prepare ``source`` if needed (a GGUF converted once into the model cache) and
        fingerprint it; ``VersionSourceError`` naming the file it could not read."""
        ...


class DeployError(Exception):
    """A deployment could not start; the message says why and what to do."""


class Catalog:
    """The deployments this gateway serves and the traffic policies choosing among them."""

    def __init__(
        self,
        deployments: Deployments,
        store: VersionStore | None = None,
        refresh_interval_s: float = 0.5,
    ) -> None:
        """``store`` None: no policies (every alias serves its first deployed version)."""
        self.deployments = deployments
        self.store = store
        self._refresh_interval_s = refresh_interval_s
        self._resolver = Resolver()
        self._policies: dict[str, TrafficPolicy] = {}
        self._revision: int | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Load the policies, then keep them in step with the store."""
        if self.store is None:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._follow(), name="tandem-policy-sync")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def refresh(self) -> None:
        """Reload the policies if the store's revision moved since the last load."""
        if self.store is None:
            return
        revision = await self.store.policy_revision()
        if revision == self._revision:
            return
        stored = await self.store.list_policies()
        policies: dict[str, TrafficPolicy] = {}
        for alias, data in stored.items():
            try:
                policies[alias] = policy_from_dict(alias, data)
            except PolicyError as exc:  # validated when set: only a hand-edited store gets here
                log.error("traffic policy of %s is invalid (%s); ignoring it", alias, exc)
        self.apply(policies)
        self._revision = revision

    def apply(self, policies: dict[str, TrafficPolicy]) -> None:
        """Put ``policies`` in force here (``refresh`` does, from the store; a catalog without
        a store, in a benchmark, is given them directly)."""
        self._resolver.replace(policies)
        self._policies = policies

    async def _follow(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self._refresh_interval_s)
            try:
                await self.refresh()
            except StoreUnavailable as exc:
                # The table in force stays; the next round tries again. Said once per outage,
                # not twice a second.
                if not failing:
                    log.warning("cannot read traffic policies (%s); keeping those in force", exc)
                failing = True
                continue
            if failing:
                log.info("traffic policies readable again")
            failing = False

    def policy(self, alias: str) -> TrafficPolicy | None:
        """The policy in force for ``alias`` on this replica."""
        return self._policies.get(alias)

    def policies(self) -> dict[str, TrafficPolicy]:
        return dict(self._policies)

    def resolve(self, requested: str, subject: Subject) -> Resolved:
        """The deployment serving a request for ``requested`` from ``subject``: 404 for a
        model nobody serves, 503 when the chosen version has no workers on this gateway."""
        compiled = self._resolver.get(requested)
        if compiled is not None:
            resolution = resolve(compiled, subject)
            deployment = self._deployed(resolution.version, requested)
            policy = compiled.policy
            if resolution.shadow is None or policy.shadow is None:
                return Resolved(deployment, resolution.reason)
            # A shadow version without workers here is skipped: it is for comparison only.
            shadow = self.deployments.get(resolution.shadow)
            return Resolved(deployment, resolution.reason, shadow, policy.shadow.max_in_flight)
        of_alias = self.deployments.of_alias(requested)
        if of_alias:
            return Resolved(of_alias[0], "only")
        named = self.deployments.get(requested)
        if named is None:
            raise self._not_found(requested)
        compiled = self._resolver.get(named.model.name)
        if compiled is not None and resolve_direct(compiled, named.version, subject) is None:
            raise self._not_found(requested)
        return Resolved(named, "direct")

    def _deployed(self, version: str, alias: str) -> Deployment:
        deployment = self.deployments.get(version)
        if deployment is None:
            raise NoHealthyWorkerError(
                f"The traffic policy of '{alias}' chose {version}, which has no workers on "
                "this gateway; retry shortly.",
                retry_after_s=_UNDEPLOYED_RETRY_AFTER_S,
            )
        return deployment

    def _not_found(self, requested: str) -> ModelNotFoundError:
        served = ", ".join(sorted(set(self.deployments.aliases()) | set(self._policies)))
        return ModelNotFoundError(
            f"The model '{requested}' does not exist or you do not have access to it; "
            f"models served here: {served}.",
            param="model",
        )

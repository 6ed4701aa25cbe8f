"""What the admin API's routes receive: its services, the admin check, tenant lookup.

The app's assembly puts one ``AdminServices`` in the lifespan state under ``ADMIN_STATE``;
routes get it (or a part) through the FastAPI dependencies below, never from ``app.state``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Depends, Header
from fastapi import Request as HttpRequest

from admission.controller import AdmissionController
from admission.quota import StoreUnavailable
from admission.registry import TenantRegistry
from admission.tenants import Tenant
from admission.tokens import TokenCounters
from billing.service import Billing
from core.errors import ConflictError, NotFoundError, StoreUnavailableError
from gateway.auth import AdminAuth, Caller
from gateway.catalog import Catalog, Deployer, VersionBuilder
from gateway.planning import GatewayPlanner
from moderation.moderator import Moderator
from rollouts.store import RolloutStore
from traffic.shadow import ShadowLimiter
from traffic.windows import VersionWindows

T = TypeVar("T")

ADMIN_STATE = "admin"


class ForgetKeys(Protocol):
    """Drops this gateway's cached answers for a key, or for every key of a tenant."""

    def __call__(self, *, key_id: str | None = None, tenant_id: str | None = None) -> None: ...


@dataclass(frozen=True, slots=True)
class AdminServices:
    """What the admin API and a tenant's own usage route use."""

    admin_auth: AdminAuth
    registry: TenantRegistry
    controller: AdmissionController
    moderator: Moderator
    """The gateway's moderation providers, which a tenant's policy may name."""
    authenticate: Callable[[str | None], Awaitable[Caller]]
    """A tenant key's caller (401 otherwise, counted as a rejection): for ``/v1/usage``."""
    forget_keys: ForgetKeys
    """``Authenticator.forget``: drops cached keys after this gateway changed them."""
    catalog: Catalog
    """The deployed versions, traffic policies and the version store."""
    windows: VersionWindows
    """Per-version figures over sliding windows."""
    shadow_comparisons: Callable[[str], list[dict[str, Any]]]
    """A shadow version's latest comparisons with the primaries it shadowed."""
    shadow_limiter: ShadowLimiter
    """Shadow copies sent, dropped at the cap, and in flight, per shadow version."""
    builder: VersionBuilder | None = None
    """Prepares and fingerprints a model source (None: registering is not possible here)."""
    deployer: Deployer | None = None
    """Starts and stops versions' workers (None: deployments are fixed at start)."""
    token_counters: TokenCounters | None = None
    """The versions' tokenizers: a deployed version's is loaded before it is routed to."""
    billing: Billing | None = None
    """None when billing is switched off."""
    rollouts: RolloutStore | None = None
    """Rollouts and their operator commands (None: no rollouts on this gateway)."""
    rollout_reports: Path | None = None
    """Where this gateway writes finished rollouts' reports."""
    planner: GatewayPlanner | None = None
    """The autoscaling planner (None: it is off)."""


async def get_admin(http_request: HttpRequest) -> AdminServices:
    # async: FastAPI runs a plain `def` dependency in a thread pool.
    services: AdminServices = getattr(http_request.state, ADMIN_STATE)
    return services


AdminDep = Annotated[AdminServices, Depends(get_admin)]


async def require_admin(
    services: AdminDep, authorization: Annotated[str | None, Header()] = None
) -> str:
    """The admin's id (the audit log's actor); 401/403 otherwise."""
    return await services.admin_auth.check(authorization)


ActorDep = Annotated[str, Depends(require_admin)]


async def get_registry(services: AdminDep) -> TenantRegistry:
    return services.registry


async def get_moderator(services: AdminDep) -> Moderator:
    return services.moderator


async def get_controller(services: AdminDep) -> AdmissionController:
    return services.controller


async def get_billing(services: AdminDep) -> Billing:
    if services.billing is None:
        raise NotFoundError("Billing is switched off on this gateway (TANDEM_BILLING=false).")
    return services.billing


RegistryDep = Annotated[TenantRegistry, Depends(get_registry)]
ModeratorDep = Annotated[Moderator, Depends(get_moderator)]
ControllerDep = Annotated[AdmissionController, Depends(get_controller)]
BillingDep = Annotated[Billing, Depends(get_billing)]


async def resolve_tenant(registry: TenantRegistry, ref: str) -> Tenant:
    """The tenant with id or name ``ref``; 404 if none."""
    tenant = await store_call(registry.get_tenant(ref))
    if tenant is None:
        tenant = await store_call(registry.find_tenant(ref))
    if tenant is None:
        raise tenant_not_found(ref)
    return tenant


async def store_call(operation: Awaitable[T]) -> T:
    """Await a registry or quota call; an unreachable store is a 503, not a 500."""
    try:
        return await operation
    except StoreUnavailable as exc:
        raise StoreUnavailableError(
            "The tenant store is unavailable; retry shortly.", retry_after_s=2.0
        ) from exc


def tenant_not_found(ref: str) -> NotFoundError:
    return NotFoundError(f"No tenant with id or name '{ref}'.", param="tenant")


async def refuse_under_rollout(
    services: AdminServices, alias: str, change: str, version: str | None = None
) -> None:
    """409 while a rollout runs (or is paused) for ``alias``: it owns the alias's policy and
    both its versions. ``version``: refuse only when the rollout uses that version."""
    if services.rollouts is None:
        return
    active = await store_call(services.rollouts.list(alias=alias, active=True, limit=1))
    if not active:
        return
    rollout = active[0]
    spec = rollout["spec"]
    if version is not None and version not in (spec["baseline"], spec["candidate"]):
        return
    rollout_id = rollout["id"]
    raise ConflictError(
        f"Rollout {rollout_id} is {rollout['status']} for '{alias}' and owns its traffic "
        f"policy and versions; promote or abort it (POST /admin/v1/rollouts/{rollout_id}/abort) "
        f"before you {change}.",
        param="version" if version is not None else "alias",
    )

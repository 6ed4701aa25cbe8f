"""The admin API, ``/admin/v1/...``: tenants, plans, keys and live usage.

Guarded by the admin credential (a tenant key gets 403). Changes are written to the registry;
every replica's key cache expires within a second, so they take effect everywhere by then.
A tenant can be named by its id or its name in every path.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, Strict

from admission.plan_codec import key_to_dict, plan_from_dict, plan_to_dict, tenant_to_dict
from admission.plans import Plan, PriorityBand
from admission.registry import (
    TenantExistsError,
    UnknownKeyError,
    UnknownTenantError,
)
from admission.tenants import ApiKey
from core.errors import ConflictError, InvalidRequestError, NotFoundError
from core.moderation import Action
from gateway.admin.deps import (
    AdminDep,
    ControllerDep,
    ModeratorDep,
    RegistryDep,
    require_admin,
    resolve_tenant,
    store_call,
    tenant_not_found,
)
from moderation.moderator import Moderator

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
# Strict: a JSON boolean or string is not a number here (true was taken as a limit of 1).
Limit = Annotated[int, Strict(), Field(ge=1)] | None


class StagePolicyFields(BaseModel):
    """Moderation of one stage: the providers that check the text and an action per category."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    providers: list[Annotated[str, Field(min_length=1)]] = []
    """Provider names: ``rules`` (built in) or a remote provider the operator configured."""
    actions: dict[str, Action] = {}
    """Category (one of OpenAI's 13, or ``pii``; ``*`` for the rest) -> allow, flag, redact or
    block."""


class ModerationFields(BaseModel):
    """A tenant's moderation policy; ``null`` follows the gateway's default."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    input: StagePolicyFields = StagePolicyFields()
    """Checked before admission: block -> 400 content_filter; redact rewrites the prompt."""
    output: StagePolicyFields = StagePolicyFields()
    """Checked on the stream: block ends the choice with finish_reason content_filter."""


class PlanFields(BaseModel):
    """Plan fields; in an update, an omitted field keeps its value and ``null`` means unlimited."""

    # The field docstrings become the OpenAPI descriptions an operator reads at /docs.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    tpm: Limit = None
    """Tokens per minute (prompt + output)."""
    rpm: Limit = None
    """Requests per minute."""
    max_concurrent: Limit = None
    """Requests running or queued at once."""
    max_prompt_tokens: Limit = None
    """Largest prompt per request."""
    max_output_tokens: Limit = None
    """Largest max_tokens per request."""
    weight: Annotated[float, Strict(), Field(gt=0, le=1000)] = 1.0
    """Fair-share weight under contention."""
    band: PriorityBand = PriorityBand.STANDARD
    """interactive, standard or batch."""
    moderation: ModerationFields | None = None
    """Input/output moderation; null follows the gateway's default policy."""

    def apply_to(self, plan: Plan, moderator: Moderator) -> Plan:
        """``plan`` with the fields this body set; 400 if its moderation policy names an
        unknown category or a provider this gateway does not have."""
        changed = self.model_fields_set & set(PlanFields.model_fields)
        values = plan_to_dict(plan) | self.model_dump(include=changed, mode="json")
        try:
            updated = plan_from_dict(values)  # the codec names an unknown category
            if updated.moderation is not None:
                moderator.check_policy(updated.moderation)  # ... and an unknown provider
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="moderation") from exc
        return updated


class TenantCreate(PlanFields):
    """``POST /admin/v1/tenants``."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    """Unique; lowercase letters, digits, ``-`` and ``_``."""


class KeyCreate(BaseModel):
    """``POST /admin/v1/tenants/{tenant}/keys``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Annotated[str, Field(min_length=1, max_length=100)] = "default"
    """A label to tell keys apart."""


router = APIRouter(prefix="/admin/v1", tags=["admin"], dependencies=[Depends(require_admin)])


@router.post("/tenants", status_code=201)
async def create_tenant(
    body: TenantCreate, registry: RegistryDep, moderator: ModeratorDep
) -> dict[str, Any]:
    """Create a tenant with a plan."""
    plan = body.apply_to(Plan(), moderator)
    try:
        tenant = await store_call(registry.create_tenant(body.name, plan))
    except TenantExistsError as exc:
        raise ConflictError(
            f"A tenant named '{body.name}' already exists.", code="tenant_exists", param="name"
        ) from exc
    return tenant_to_dict(tenant)


@router.get("/tenants")
async def list_tenants(registry: RegistryDep) -> dict[str, Any]:
    """Every tenant, by name."""
    tenants = await store_call(registry.list_tenants())
    return {"object": "list", "data": [tenant_to_dict(tenant) for tenant in tenants]}


@router.get("/tenants/{tenant}")
async def get_tenant(tenant: str, registry: RegistryDep) -> dict[str, Any]:
    """One tenant."""
    return tenant_to_dict(await resolve_tenant(registry, tenant))


@router.patch("/tenants/{tenant}")
async def update_tenant(
    tenant: str,
    body: PlanFields,
    registry: RegistryDep,
    moderator: ModeratorDep,
    services: AdminDep,
) -> dict[str, Any]:
    """Change quotas, weight, band or moderation; omitted fields keep their values."""
    current = await resolve_tenant(registry, tenant)
    plan = body.apply_to(current.plan, moderator)
    try:
        updated = await store_call(registry.update_tenant(current.tenant_id, plan))
    except UnknownTenantError as exc:
        raise tenant_not_found(tenant) from exc
    services.forget_keys(tenant_id=current.tenant_id)
    return tenant_to_dict(updated)


@router.delete("/tenants/{tenant}")
async def delete_tenant(
    tenant: str,
    registry: RegistryDep,
    controller: ControllerDep,
    services: AdminDep,
) -> dict[str, Any]:
    """Delete a tenant, its keys and its quota counters."""
    current = await resolve_tenant(registry, tenant)
    try:
        await store_call(registry.delete_tenant(current.tenant_id))
    except UnknownTenantError as exc:
        raise tenant_not_found(tenant) from exc
    services.forget_keys(tenant_id=current.tenant_id)
    await store_call(controller.forget(current.tenant_id))
    return {"id": current.tenant_id, "object": "tenant", "deleted": True}


@router.post("/tenants/{tenant}/keys", status_code=201)
async def issue_key(
    tenant: str, registry: RegistryDep, body: KeyCreate | None = None
) -> dict[str, Any]:
    """Issue a key. Its plaintext is in this response only: it is stored hashed."""
    current = await resolve_tenant(registry, tenant)
    try:
        issued = await store_call(registry.issue_key(current.tenant_id, (body or KeyCreate()).name))
    except UnknownTenantError as exc:
        raise tenant_not_found(tenant) from exc
    return {**_public_key(issued.key), "key": issued.plaintext}


@router.get("/tenants/{tenant}/keys")
async def list_keys(tenant: str, registry: RegistryDep) -> dict[str, Any]:
    """A tenant's keys (never their secrets), revoked ones included."""
    current = await resolve_tenant(registry, tenant)
    keys = await store_call(registry.list_keys(current.tenant_id))
    return {"object": "list", "data": [_public_key(key) for key in keys]}


@router.post("/keys/{key_id}/revoke")
async def revoke_key(key_id: str, registry: RegistryDep, services: AdminDep) -> dict[str, Any]:
    """Revoke a key; requests with it get 401 here at once, on every replica within a second."""
    try:
        key = await store_call(registry.revoke_key(key_id))
    except UnknownKeyError as exc:
        raise NotFoundError(f"No API key with id '{key_id}'.", param="key_id") from exc
    services.forget_keys(key_id=key.key_id)
    return _public_key(key)


@router.get("/tenants/{tenant}/usage")
async def tenant_usage(
    tenant: str,
    registry: RegistryDep,
    controller: ControllerDep,
) -> dict[str, Any]:
    """Live quota state: limits, what remains now, when buckets are full again, requests in
    flight (all replicas), queued (this replica), and its VTC fairness counter (this replica;
    null at its band's floor)."""
    current = await resolve_tenant(registry, tenant)
    snapshot = await store_call(controller.snapshot(current))
    return {
        "tenant_id": current.tenant_id,
        "name": current.name,
        "plan": plan_to_dict(current.plan),
        "requests": {
            "limit_per_minute": snapshot.limit_requests,
            "remaining": snapshot.remaining_requests,
            "reset_s": round(snapshot.reset_requests_s, 3),
        },
        "tokens": {
            "limit_per_minute": snapshot.limit_tokens,
            "remaining": snapshot.remaining_tokens,
            "reset_s": round(snapshot.reset_tokens_s, 3),
        },
        "concurrent": snapshot.concurrent,
        "queued_here": controller.num_queued(current.tenant_id),
        "fairness_counter_here": controller.fairness_counter(current.tenant_id),
    }


def _public_key(key: ApiKey) -> dict[str, Any]:
    """A key as the admin API shows it: not even its hash leaves the gateway."""
    shown = key_to_dict(key)
    del shown["key_hash"]
    return shown

"""Where tenants and keys live: a local SQLite file (embedded default) or Redis (replicas)."""

from __future__ import annotations

from typing import Protocol

from admission.plans import Plan
from admission.tenants import ApiKey, IssuedKey, Tenant


class TenantExistsError(Exception):
    """A tenant with that name already exists."""


class UnknownTenantError(Exception):
    """No tenant with that id."""


class UnknownKeyError(Exception):
    """No key with that id."""


class TenantRegistry(Protocol):
    """CRUD over tenants and keys. Every method may raise ``StoreUnavailable``
    (``admission.quota``) when the backing store cannot be reached."""

    async def create_tenant(self, name: str, plan: Plan) -> Tenant:
        """Create a tenant; ``TenantExistsError`` if the name is taken."""
        ...

    async def list_tenants(self) -> list[Tenant]:
        """Every tenant, ordered by name."""
        ...

    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        """One tenant by id."""
        ...

    async def find_tenant(self, name: str) -> Tenant | None:
        """One tenant by name."""
        ...

    async def update_tenant(self, tenant_id: str, plan: Plan) -> Tenant:
        """Replace a tenant's plan; ``UnknownTenantError`` if there is none."""
        ...

    async def delete_tenant(self, tenant_id: str) -> None:
        """Delete a tenant and every key of it; ``UnknownTenantError`` if there is none."""
        ...

    async def issue_key(self, tenant_id: str, name: str) -> IssuedKey:
        """A new key for a tenant; ``UnknownTenantError`` if there is none."""
        ...

    async def list_keys(self, tenant_id: str) -> list[ApiKey]:
        """A tenant's keys, revoked ones included, oldest first."""
        ...

    async def revoke_key(self, key_id: str) -> ApiKey:
        """Revoke a key (idempotent: the first revocation time is kept);
        ``UnknownKeyError`` if there is none."""
        ...

    async def lookup_key(self, key_hash: str) -> tuple[ApiKey, Tenant] | None:
        """The key with that hash and its tenant (revoked keys included: the caller decides)."""
        ...

    async def touch_keys(self, last_used: dict[str, float]) -> None:
        """Record last-used times (key id -> Unix seconds), batched by the caller; a time
        never moves backwards."""
        ...

    async def aclose(self) -> None:
        """Release the connection."""
        ...

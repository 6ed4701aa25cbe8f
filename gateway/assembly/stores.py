"""Building the tenant registry, the quota store and the idempotency store the configuration
asks for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from uuid import uuid4

from admission.idempotency import IdempotencyStore, MemoryIdempotencyStore
from admission.idempotency_redis import RedisIdempotencyStore
from admission.quota import QuotaStore
from admission.quota_memory import MemoryQuotaStore
from admission.quota_redis import RedisQuotaStore
from admission.registry import TenantRegistry
from admission.registry_redis import RedisTenantRegistry
from admission.registry_sqlite import SqliteTenantRegistry
from billing.spend_redis import RedisSpend
from rollouts.lease import Lease, RedisLease, SqliteLease
from rollouts.store import RolloutStore
from rollouts.store_redis import RedisRolloutStore
from rollouts.store_sqlite import SqliteRolloutStore
from versions.store import VersionStore
from versions.store_redis import RedisVersionStore
from versions.store_sqlite import SqliteVersionStore


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Where tenants, keys and quota counters live."""

    redis_url: str | None = None
    """Shared Redis (replicas); unset = SQLite registry + in-memory counters."""
    sqlite_path: Path = Path(".tandem/tandem.db")
    """The embedded default's durable tenant store; model versions, traffic policies and the
    audit log go to ``versions.db`` beside it, rollouts to ``rollouts.db`` and their lease to
    ``lease.db`` (the planner's lease too)."""
    timeout_s: float = 2.0
    """Longest wait for a Redis operation before it counts as failed (see
    ``TandemSettings.store_timeout_s``)."""


@dataclass(frozen=True, slots=True)
class Stores:
    registry: TenantRegistry
    quotas: QuotaStore
    idempotency: IdempotencyStore
    versions: VersionStore
    rollouts: RolloutStore
    lease: Lease
    """Which gateway evaluates rollouts."""

    async def aclose(self) -> None:
        await self.lease.aclose()
        await self.rollouts.aclose()
        await self.versions.aclose()
        await self.idempotency.aclose()
        await self.quotas.aclose()
        await self.registry.aclose()


async def open_stores(config: StoreConfig) -> Stores:
    """Open the configured stores (the caller closes them)."""
    if config.redis_url:
        return Stores(
            RedisTenantRegistry(config.redis_url, timeout_s=config.timeout_s),
            RedisQuotaStore(config.redis_url, timeout_s=config.timeout_s),
            RedisIdempotencyStore(config.redis_url, timeout_s=config.timeout_s),
            RedisVersionStore(config.redis_url, timeout_s=config.timeout_s),
            RedisRolloutStore(config.redis_url, timeout_s=config.timeout_s),
            await open_lease(config, "rollouts"),
        )
    registry = SqliteTenantRegistry(config.sqlite_path)
    await registry.start()
    versions = SqliteVersionStore(config.sqlite_path.with_name("versions.db"))
    await versions.start()
    rollouts = SqliteRolloutStore(config.sqlite_path.with_name("rollouts.db"))
    await rollouts.start()
    lease = await open_lease(config, "rollouts")
    return Stores(registry, MemoryQuotaStore(), MemoryIdempotencyStore(), versions, rollouts, lease)


async def open_lease(config: StoreConfig, name: str) -> Lease:
    """The lease called ``name`` (``rollouts``, ``planner``), where the stores live: Redis, or
    ``lease.db`` beside the tenant store (one row per name). The caller closes it."""
    if config.redis_url:
        return RedisLease(config.redis_url, name=name, timeout_s=config.timeout_s)
    lease = SqliteLease(config.sqlite_path.with_name("lease.db"), name=name)
    await lease.start()
    return lease


def open_spend_store(config: StoreConfig) -> RedisSpend | None:
    """The monthly spend counter budgets share (Redis), or None: one gateway, whose budgets
    are its own view of the ledger. The caller hands it to ``Billing``, which closes it."""
    if not config.redis_url:
        return None
    return RedisSpend(config.redis_url, source=uuid4().hex, timeout_s=config.timeout_s)

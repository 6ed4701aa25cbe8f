"""Building the tenant registry, the quota store and the idempotency store the configuration
asks for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from admission.idempotency import IdempotencyStore, MemoryIdempotencyStore
from admission.idempotency_redis import RedisIdempotencyStore
from admission.quota import QuotaStore
from admission.quota_memory import MemoryQuotaStore
from admission.quota_redis import RedisQuotaStore
from admission.registry import TenantRegistry
from admission.registry_redis import RedisTenantRegistry
from admission.registry_sqlite import SqliteTenantRegistry


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Where tenants, keys and quota counters live."""

    redis_url: str | None = None
    """Shared Redis (replicas); unset = SQLite registry + in-memory counters."""
    sqlite_path: Path = Path(".tandem/tandem.db")
    """The embedded default's durable tenant store."""
    timeout_s: float = 2.0
    """Longest wait for a Redis operation before it counts as failed (see
    ``TandemSettings.store_timeout_s``)."""


@dataclass(frozen=True, slots=True)
class Stores:
    registry: TenantRegistry
    quotas: QuotaStore
    idempotency: IdempotencyStore

    async def aclose(self) -> None:
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
        )
    registry = SqliteTenantRegistry(config.sqlite_path)
    await registry.start()
    return Stores(registry, MemoryQuotaStore(), MemoryIdempotencyStore())

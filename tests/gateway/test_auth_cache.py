"""The key cache (``gateway/auth.py``): fresh for its TTL, then served while one background
lookup refreshes it, for a bounded time; past that a request waits for the store.

A real SQLite registry and a fake clock: the lookup's timing is the test's, not the machine's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from admission.plans import Plan
from admission.registry_sqlite import SqliteTenantRegistry
from core.errors import AuthenticationError
from gateway.auth import Authenticator

TTL_S = 0.5
AHEAD_S = 0.4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def registry(tmp_path: Path) -> AsyncIterator[SqliteTenantRegistry]:
    registry = SqliteTenantRegistry(tmp_path / "tenants.sqlite3")
    await registry.start()
    yield registry
    await registry.aclose()


async def _settled() -> None:
    """Let a background lookup (a hop to the store's thread) finish."""
    for _ in range(50):
        await asyncio.sleep(0.01)


async def _cached_keys(
    registry: SqliteTenantRegistry, clock: Clock, num_keys: int = 1
) -> tuple[Authenticator, list[tuple[str, str]]]:
    """An authenticator on ``clock`` and ``num_keys`` keys of one tenant, each authenticated
    once (so cached): their ``Authorization`` headers and key ids."""
    auth = Authenticator(registry, cache_ttl_s=TTL_S, refresh_ahead_s=AHEAD_S, clock=clock)
    tenant = await registry.create_tenant("acme", Plan())
    keys = []
    for i in range(num_keys):
        issued = await registry.issue_key(tenant.tenant_id, f"k{i}")
        header = f"Bearer {issued.plaintext}"
        assert (await auth.authenticate(header)).tenant.name == "acme"
        keys.append((header, issued.key.key_id))
    return auth, keys


async def _assert_revoked(auth: Authenticator, header: str) -> None:
    with pytest.raises(AuthenticationError) as refused:
        await auth.authenticate(header)
    assert refused.value.code == "revoked_api_key"


async def test_a_revoked_key_is_served_from_the_cache_at_most_until_ttl_plus_refresh_ahead(
    registry: SqliteTenantRegistry,
) -> None:
    clock = Clock()
    auth, [(header, key_id)] = await _cached_keys(registry, clock)
    await registry.revoke_key(key_id)

    clock.now += TTL_S / 2  # fresh: the cached answer, no lookup
    assert (await auth.authenticate(header)).tenant.name == "acme"

    clock.now += TTL_S / 2 + AHEAD_S / 2  # stale but within the refresh-ahead: still served ...
    assert (await auth.authenticate(header)).tenant.name == "acme"
    await _settled()  # ... while one lookup in the background reads the revocation
    await _assert_revoked(auth, header)


async def test_past_the_refresh_ahead_a_request_waits_for_the_store(
    registry: SqliteTenantRegistry,
) -> None:
    clock = Clock()
    auth, [(header, key_id)] = await _cached_keys(registry, clock)
    await registry.revoke_key(key_id)

    clock.now += TTL_S + AHEAD_S + 0.01  # too old to serve: this request's own lookup decides
    await _assert_revoked(auth, header)


async def test_a_key_revoked_on_this_gateway_is_refused_here_at_once(
    registry: SqliteTenantRegistry,
) -> None:
    clock = Clock()
    auth, [(header, key_id), (other_header, _)] = await _cached_keys(registry, clock, 2)
    await registry.revoke_key(key_id)

    auth.forget(key_id=key_id)  # what the admin API's revocation does here
    await _assert_revoked(auth, header)  # still fresh by the clock: no cache to hide it
    assert (await auth.authenticate(other_header)).tenant.name == "acme"  # the other key stays

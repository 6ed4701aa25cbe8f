"""The key cache (``gateway/auth.py``): an answer is served for a bounded time (TTL plus
refresh-ahead), the keys in use are looked up again by a refresh round every TTL, and past
the bound a request waits for the store.

A real SQLite registry and a fake clock: the lookup's timing is the test's, not the machine's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from admission.plans import Plan
from admission.registry_sqlite import SqliteTenantRegistry
from admission.tenants import ApiKey, Tenant, hash_key
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

    clock.now += TTL_S / 2 + AHEAD_S / 2  # stale but within the refresh-ahead: still served,
    assert (await auth.authenticate(header)).tenant.name == "acme"
    await _settled()  # and no request started a lookup: the refresh rounds do
    assert (await auth.authenticate(header)).tenant.name == "acme"
    await auth.refresh_in_use()  # the round reads the revocation
    await _assert_revoked(auth, header)


async def test_a_refresh_round_looks_up_only_the_known_keys_used_since_the_last_one(
    registry: SqliteTenantRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    auth, [(used, used_id), (idle, idle_id)] = await _cached_keys(registry, clock, 2)
    with pytest.raises(AuthenticationError):
        await auth.authenticate("Bearer sk-no-such-key")
    await auth.refresh_in_use()  # the three lookups above were all in use
    await registry.revoke_key(used_id)
    await registry.revoke_key(idle_id)
    looked_up: list[str] = []
    lookup_key = registry.lookup_key

    async def counted(digest: str) -> tuple[ApiKey, Tenant] | None:
        looked_up.append(digest)
        return await lookup_key(digest)

    monkeypatch.setattr(registry, "lookup_key", counted)
    clock.now += TTL_S / 2
    assert (await auth.authenticate(used)).tenant.name == "acme"
    with pytest.raises(AuthenticationError):
        await auth.authenticate("Bearer sk-no-such-key")  # unknown: cached as unknown
    await auth.refresh_in_use()
    assert looked_up == [hash_key(used.removeprefix("Bearer "))]  # not the idle or unknown key
    await _assert_revoked(auth, used)  # the round's answer is served at once
    assert (await auth.authenticate(idle)).tenant.name == "acme"  # until it ages out


async def test_started_the_refresh_rounds_run_on_their_own(
    registry: SqliteTenantRegistry,
) -> None:
    clock = Clock()
    auth, [(header, key_id)] = await _cached_keys(registry, clock)
    await auth.start()
    try:
        await registry.revoke_key(key_id)
        clock.now += TTL_S  # stale: served, and no request looks it up
        assert (await auth.authenticate(header)).tenant.name == "acme"
        await asyncio.sleep(2 * TTL_S + 0.2)  # real time: two rounds on the event loop's clock
        await _assert_revoked(auth, header)
    finally:
        await auth.aclose()


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

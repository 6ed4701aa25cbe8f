"""Both tenant registries, one suite: SQLite in a temporary folder and a real ``redis-server``
(the session's ``redis_url``, one key prefix per test). Then what only one backend has:
SQLite's schema and file errors, Redis outages and leftovers. The plan codec comes first."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from redis.asyncio import Redis

from admission.plan_codec import (
    key_from_dict,
    key_to_dict,
    plan_from_dict,
    plan_to_dict,
    tenant_from_dict,
    tenant_to_dict,
)
from admission.plans import Plan, PriorityBand
from admission.quota import StoreUnavailable
from admission.registry import (
    TenantExistsError,
    TenantRegistry,
    UnknownKeyError,
    UnknownTenantError,
)
from admission.registry_redis import RedisTenantRegistry
from admission.registry_sqlite import SCHEMA_VERSION, SqliteTenantRegistry
from admission.tenants import KEY_PREFIX, ApiKey, Tenant, display_prefix, hash_key
from tests.redis_server import running_redis

FULL_PLAN = Plan(
    tpm=120_000,
    rpm=600,
    max_concurrent=8,
    max_prompt_tokens=4096,
    max_output_tokens=1024,
    weight=2.5,
    band=PriorityBand.INTERACTIVE,
)
# More significant digits than Lua's cjson keeps (14): a store that rounds times fails here.
PRECISE_TIME = 1732281234.1234567


# --- the codec ---------------------------------------------------------------------------------


def test_plan_round_trips_through_json_with_every_field() -> None:
    data = plan_to_dict(FULL_PLAN)
    assert set(data) == {f.name for f in dataclasses.fields(Plan)}
    assert data["band"] == "interactive" and type(data["band"]) is str
    assert plan_from_dict(json.loads(json.dumps(data))) == FULL_PLAN


def test_plan_from_dict_ignores_unknown_keys_and_defaults_missing_ones() -> None:
    assert plan_from_dict({}) == Plan()
    assert plan_from_dict({"tpm": 10, "added_in_a_later_version": True}) == Plan(tpm=10)
    weight = plan_from_dict({"weight": 2}).weight
    assert weight == 2.0 and isinstance(weight, float)


@pytest.mark.parametrize(
    ("data", "field_name"),
    [
        ({"tpm": "1000"}, "tpm"),
        ({"rpm": True}, "rpm"),
        ({"max_concurrent": 1.5}, "max_concurrent"),
        ({"weight": "heavy"}, "weight"),
        ({"band": "gold"}, "band"),
    ],
)
def test_plan_from_dict_names_the_bad_field(data: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        plan_from_dict(data)


def test_tenant_and_key_round_trip_through_json() -> None:
    tenant = Tenant("ten_1", "acme", FULL_PLAN, created_at=PRECISE_TIME, updated_at=PRECISE_TIME)
    key = ApiKey("key_1", "ten_1", "ci", "tdm-abcdefgh", "ff" * 32, PRECISE_TIME, 1.5, 2.5)
    assert tenant_from_dict(json.loads(json.dumps(tenant_to_dict(tenant)))) == tenant
    assert key_from_dict(json.loads(json.dumps(key_to_dict(key)))) == key
    unused = dataclasses.replace(key, revoked_at=None, last_used_at=None)
    assert key_from_dict(json.loads(json.dumps(key_to_dict(unused)))) == unused


# --- both registries ---------------------------------------------------------------------------


@dataclass
class Backend:
    """One store and how to open registries over it (two at once act like two replicas)."""

    name: str
    open_registry: Callable[[], TenantRegistry]
    raw_dump: Callable[[], Awaitable[bytes]]
    """Every byte the store holds, to search for what must not be there."""
    opened: list[TenantRegistry] = field(default_factory=list)

    def make(self) -> TenantRegistry:
        registry = self.open_registry()
        self.opened.append(registry)
        return registry


@pytest.fixture(params=["sqlite", "redis"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "sqlite":
        path = tmp_path / "state" / "registry.db"

        async def sqlite_dump() -> bytes:
            files = [path, path.with_name(path.name + "-wal")]
            return b"".join(await asyncio.to_thread(_read_all, files))

        backend = Backend("sqlite", lambda: SqliteTenantRegistry(path), sqlite_dump)
        yield backend
        for registry in backend.opened:
            await registry.aclose()
        return

    url: str = request.getfixturevalue("redis_url")
    prefix = f"test:{uuid4().hex}:"
    raw = Redis.from_url(url)

    async def redis_dump() -> bytes:
        return await _redis_dump(raw, prefix)

    backend = Backend(
        "redis", lambda: RedisTenantRegistry(url, key_prefix=prefix, timeout_s=2.0), redis_dump
    )
    yield backend
    for registry in backend.opened:
        await registry.aclose()
    stale = [key async for key in raw.scan_iter(match=f"{prefix}*")]
    if stale:
        await raw.delete(*stale)
    await raw.aclose()


@pytest.fixture
def registry(backend: Backend) -> TenantRegistry:
    return backend.make()


async def test_create_get_and_find(registry: TenantRegistry) -> None:
    tenant = await registry.create_tenant("acme", FULL_PLAN)
    assert tenant.tenant_id.startswith("ten_")
    assert (tenant.name, tenant.plan) == ("acme", FULL_PLAN)
    assert tenant.created_at == tenant.updated_at > 0
    assert await registry.get_tenant(tenant.tenant_id) == tenant
    assert await registry.find_tenant("acme") == tenant
    assert await registry.get_tenant("ten_missing") is None
    assert await registry.find_tenant("missing") is None


async def test_list_is_ordered_by_name(registry: TenantRegistry) -> None:
    assert await registry.list_tenants() == []
    for name in ("charlie", "alpha", "bravo"):
        await registry.create_tenant(name, Plan())
    assert [tenant.name for tenant in await registry.list_tenants()] == [
        "alpha",
        "bravo",
        "charlie",
    ]


async def test_update_replaces_the_plan_only(registry: TenantRegistry) -> None:
    tenant = await registry.create_tenant("acme", Plan())
    updated = await registry.update_tenant(tenant.tenant_id, FULL_PLAN)
    assert updated.plan == FULL_PLAN
    assert (updated.tenant_id, updated.name, updated.created_at) == (
        tenant.tenant_id,
        "acme",
        tenant.created_at,
    )
    assert updated.updated_at >= tenant.updated_at
    assert await registry.get_tenant(tenant.tenant_id) == updated
    assert await registry.find_tenant("acme") == updated
    with pytest.raises(UnknownTenantError):
        await registry.update_tenant("ten_missing", FULL_PLAN)


async def test_a_taken_name_is_refused_until_its_tenant_is_deleted(
    registry: TenantRegistry,
) -> None:
    first = await registry.create_tenant("acme", Plan())
    with pytest.raises(TenantExistsError):
        await registry.create_tenant("acme", FULL_PLAN)
    assert await registry.find_tenant("acme") == first
    await registry.delete_tenant(first.tenant_id)
    second = await registry.create_tenant("acme", FULL_PLAN)
    assert second.tenant_id != first.tenant_id
    assert await registry.find_tenant("acme") == second


async def test_unknown_ids_raise_the_right_errors(registry: TenantRegistry) -> None:
    with pytest.raises(UnknownTenantError):
        await registry.delete_tenant("ten_missing")
    with pytest.raises(UnknownTenantError):
        await registry.issue_key("ten_missing", "ci")
    with pytest.raises(UnknownKeyError):
        await registry.revoke_key("key_missing")
    assert await registry.list_keys("ten_missing") == []
    assert await registry.lookup_key(hash_key("tdm-never-issued")) is None


async def test_an_issued_key_is_found_by_its_hash_and_its_plaintext_is_not_stored(
    backend: Backend, registry: TenantRegistry
) -> None:
    tenant = await registry.create_tenant("acme", FULL_PLAN)
    issued = await registry.issue_key(tenant.tenant_id, "ci")
    plaintext, key = issued.plaintext, issued.key
    assert plaintext.startswith(KEY_PREFIX)
    assert key.key_id.startswith("key_")
    assert (key.tenant_id, key.name) == (tenant.tenant_id, "ci")
    assert key.key_hash == hash_key(plaintext)
    assert key.display_prefix == display_prefix(plaintext) != plaintext
    assert (key.revoked_at, key.last_used_at) == (None, None)
    assert plaintext not in dataclasses.astuple(key)

    assert await registry.lookup_key(key.key_hash) == (key, tenant)
    assert await registry.list_keys(tenant.tenant_id) == [key]

    stored = await backend.raw_dump()
    assert key.key_hash.encode() in stored  # the dump does hold the key...
    secret = plaintext[len(key.display_prefix) :]
    assert secret.encode() not in stored  # ...but none of the part never shown


async def test_keys_are_listed_oldest_first_revoked_included(registry: TenantRegistry) -> None:
    tenant = await registry.create_tenant("acme", Plan())
    other = await registry.create_tenant("globex", Plan())
    first = await registry.issue_key(tenant.tenant_id, "first")
    second = await registry.issue_key(tenant.tenant_id, "second")
    await registry.issue_key(other.tenant_id, "elsewhere")
    revoked = await registry.revoke_key(first.key.key_id)
    assert await registry.list_keys(tenant.tenant_id) == [revoked, second.key]


async def test_revoking_is_idempotent_and_lookup_still_returns_the_key(
    registry: TenantRegistry,
) -> None:
    tenant = await registry.create_tenant("acme", Plan())
    issued = await registry.issue_key(tenant.tenant_id, "ci")
    revoked = await registry.revoke_key(issued.key.key_id)
    assert revoked.revoked_at is not None and revoked.revoked_at >= issued.key.created_at
    assert revoked == dataclasses.replace(issued.key, revoked_at=revoked.revoked_at)
    again = await registry.revoke_key(issued.key.key_id)
    assert again == revoked  # the first revocation time is kept
    found = await registry.lookup_key(issued.key.key_hash)
    assert found == (revoked, tenant)


async def test_deleting_a_tenant_removes_its_keys(registry: TenantRegistry) -> None:
    doomed = await registry.create_tenant("doomed", Plan())
    kept = await registry.create_tenant("kept", Plan())
    doomed_keys = [await registry.issue_key(doomed.tenant_id, name) for name in ("a", "b")]
    kept_key = await registry.issue_key(kept.tenant_id, "c")
    await registry.revoke_key(doomed_keys[1].key.key_id)

    await registry.delete_tenant(doomed.tenant_id)

    assert await registry.get_tenant(doomed.tenant_id) is None
    assert await registry.find_tenant("doomed") is None
    assert await registry.list_tenants() == [kept]
    assert await registry.list_keys(doomed.tenant_id) == []
    for issued in doomed_keys:
        assert await registry.lookup_key(issued.key.key_hash) is None
        with pytest.raises(UnknownKeyError):
            await registry.revoke_key(issued.key.key_id)
    await registry.touch_keys({doomed_keys[0].key.key_id: 10.0})  # a deleted key is skipped
    assert await registry.lookup_key(kept_key.key.key_hash) == (kept_key.key, kept)
    with pytest.raises(UnknownTenantError):
        await registry.delete_tenant(doomed.tenant_id)


async def test_touch_never_moves_a_time_backwards(registry: TenantRegistry) -> None:
    tenant = await registry.create_tenant("acme", Plan())
    one = (await registry.issue_key(tenant.tenant_id, "one")).key
    two = (await registry.issue_key(tenant.tenant_id, "two")).key

    async def last_used() -> list[float | None]:
        return [key.last_used_at for key in await registry.list_keys(tenant.tenant_id)]

    await registry.touch_keys({})
    assert await last_used() == [None, None]
    await registry.touch_keys({one.key_id: 1000.5})
    assert await last_used() == [1000.5, None]
    await registry.touch_keys({one.key_id: 900.0, two.key_id: 2000.25, "key_missing": 5.0})
    assert await last_used() == [1000.5, 2000.25]
    await registry.touch_keys({one.key_id: PRECISE_TIME})
    assert await last_used() == [PRECISE_TIME, 2000.25]

    revoked = await registry.revoke_key(one.key_id)
    assert revoked.last_used_at == PRECISE_TIME
    found = await registry.lookup_key(one.key_hash)
    assert found is not None and found[0].last_used_at == PRECISE_TIME


async def test_a_new_registry_over_the_same_store_sees_everything(backend: Backend) -> None:
    """For SQLite: the file survives a close and a re-open."""
    registry = backend.make()
    tenant = await registry.create_tenant("acme", FULL_PLAN)
    issued = await registry.issue_key(tenant.tenant_id, "ci")
    await registry.touch_keys({issued.key.key_id: PRECISE_TIME})
    revoked = await registry.revoke_key(issued.key.key_id)
    await registry.aclose()

    reopened = backend.make()
    assert await reopened.list_tenants() == [tenant]
    assert await reopened.list_keys(tenant.tenant_id) == [revoked]
    assert await reopened.lookup_key(issued.key.key_hash) == (revoked, tenant)


async def test_concurrent_creates_of_one_name_across_two_registries_let_one_win(
    backend: Backend,
) -> None:
    replicas = [backend.make(), backend.make()]
    results = await asyncio.gather(
        *(replicas[i % 2].create_tenant("acme", Plan(rpm=i)) for i in range(20)),
        return_exceptions=True,
    )
    winners = [result for result in results if isinstance(result, Tenant)]
    assert len(winners) == 1
    losers = [r for r in results if r is not winners[0]]
    assert all(isinstance(r, TenantExistsError) for r in losers), [repr(r) for r in losers]
    for replica in replicas:
        assert await replica.list_tenants() == winners


# --- SQLite only -------------------------------------------------------------------------------


async def test_sqlite_start_creates_folders_wal_and_the_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "registry.db"
    registry = SqliteTenantRegistry(path)
    assert not path.parent.exists()  # construction does no I/O
    await registry.start()
    await registry.aclose()
    journal_mode, user_version, tables = await asyncio.to_thread(_inspect, path)
    assert journal_mode == "wal"
    assert user_version == SCHEMA_VERSION
    assert {"tenants", "api_keys"} <= tables


async def test_sqlite_refuses_a_file_from_a_newer_gateway(tmp_path: Path) -> None:
    path = tmp_path / "registry.db"
    await asyncio.to_thread(_set_user_version, path, SCHEMA_VERSION + 1)
    registry = SqliteTenantRegistry(path)
    with pytest.raises(StoreUnavailable, match="newer"):
        await registry.start()
    await registry.aclose()


async def test_sqlite_errors_become_store_unavailable(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    for path in (tmp_path, a_file / "registry.db"):  # a folder; a folder that is a file
        registry = SqliteTenantRegistry(path)
        with pytest.raises(StoreUnavailable) as caught:
            await registry.get_tenant("ten_1")
        assert isinstance(caught.value.__cause__, sqlite3.Error | OSError)
        await registry.aclose()


async def test_sqlite_refuses_calls_after_close(tmp_path: Path) -> None:
    registry = SqliteTenantRegistry(tmp_path / "registry.db")
    await registry.create_tenant("acme", Plan())
    await registry.aclose()
    await registry.aclose()  # idempotent
    with pytest.raises(StoreUnavailable, match="closed"):
        await registry.list_tenants()


# --- Redis only --------------------------------------------------------------------------------


async def test_redis_deleting_every_tenant_leaves_no_key_behind(redis_url: str) -> None:
    prefix = f"test:{uuid4().hex}:"
    registry = RedisTenantRegistry(redis_url, key_prefix=prefix)
    raw = Redis.from_url(redis_url)
    try:
        for name in ("acme", "globex"):
            tenant = await registry.create_tenant(name, FULL_PLAN)
            issued = await registry.issue_key(tenant.tenant_id, "ci")
            await registry.touch_keys({issued.key.key_id: 5.0})
            await registry.revoke_key(issued.key.key_id)
        assert len([key async for key in raw.scan_iter(match=f"{prefix}*")]) > 0
        for tenant in await registry.list_tenants():
            await registry.delete_tenant(tenant.tenant_id)
        assert [key async for key in raw.scan_iter(match=f"{prefix}*")] == []
    finally:
        await registry.aclose()
        await raw.aclose()


async def test_redis_outage_and_silence_become_store_unavailable_then_recover() -> None:
    with running_redis() as server:
        registry = RedisTenantRegistry(server.url, key_prefix="t:", timeout_s=0.2)
        try:
            tenant = await registry.create_tenant("acme", Plan())

            server.pause()  # accepts connections, never answers
            try:
                with pytest.raises(StoreUnavailable) as caught:
                    await registry.get_tenant(tenant.tenant_id)
                assert caught.value.__cause__ is not None
            finally:
                server.resume()
            assert await registry.get_tenant(tenant.tenant_id) == tenant

            server.stop()  # refuses connections
            with pytest.raises(StoreUnavailable) as caught:
                await registry.create_tenant("globex", Plan())
            assert caught.value.__cause__ is not None
            server.start()  # no persistence: an empty store, but a working one
            assert await registry.get_tenant(tenant.tenant_id) is None
            assert (await registry.create_tenant("globex", Plan())).name == "globex"
        finally:
            await registry.aclose()


# --- helpers -----------------------------------------------------------------------------------


def _read_all(paths: list[Path]) -> list[bytes]:
    return [path.read_bytes() for path in paths if path.exists()]


async def _redis_dump(raw: Redis, prefix: str) -> bytes:
    parts: list[bytes] = []
    async for name in raw.scan_iter(match=f"{prefix}*"):
        parts.append(_bytes(name))
        kind = await raw.type(name)
        if kind == b"string":
            parts.append(_bytes(await raw.get(name) or b""))
        elif kind == b"hash":
            for item in (await raw.hgetall(name)).items():
                parts.extend(map(_bytes, item))
        elif kind == b"set":
            parts.extend(map(_bytes, await raw.smembers(name)))
        else:
            raise AssertionError(f"unexpected type {kind!r} of {name!r}")
    return b"\n".join(parts)


def _bytes(value: bytes | str) -> bytes:
    # The raw client does not decode; str only appears in the client's signatures.
    return value if isinstance(value, bytes) else value.encode()


def _inspect(path: Path) -> tuple[str, int, set[str]]:
    with sqlite3.connect(path) as conn:
        (journal_mode,) = conn.execute("PRAGMA journal_mode").fetchone()
        (user_version,) = conn.execute("PRAGMA user_version").fetchone()
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    return journal_mode, user_version, tables


def _set_user_version(path: Path, version: int) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {version}")
    conn.close()

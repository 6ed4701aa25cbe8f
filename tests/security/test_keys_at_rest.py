"""API keys are stored as hashes only: after keys are issued, revoked and used for every kind of
request, no issued key (nor the admin key) is anywhere in what the gateway stores: the raw
bytes of every SQLite file (database, WAL and shared memory, while it runs and after it
stopped), every key and value of a real Redis, every row of every table of a real PostgreSQL
ledger, and the billing spool on disk. Each check also finds what must be there (the keys'
hashes, their ids), so it cannot pass by reading nothing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql
from redis.asyncio import Redis

from admission.tenants import hash_key
from billing.service import BillingConfig
from gateway.assembly.app import AccessConfig
from gateway.assembly.stores import StoreConfig
from tests.gateway.conftest import ADMIN_KEY, MODEL, FakeStack, make_fake_stack
from tests.postgres_server import PostgresServer
from tests.redis_server import RedisServer, running_redis
from tests.security.leaks import Secret, leaks_in, tenant_keys


@dataclass(frozen=True)
class Issued:
    """What ``use_keys`` issued: the secrets, and their public traces (hash, key id)."""

    keys: list[str]
    key_ids: list[str]

    @property
    def secrets(self) -> list[Secret]:
        return [Secret("admin key", ADMIN_KEY), *tenant_keys(self.keys)]

    @property
    def hashes(self) -> list[str]:
        return [hash_key(key) for key in self.keys]


async def use_keys(stack: FakeStack) -> Issued:
    """Two tenants (one with its request log on and a budget), a second key for one, a
    revoked key; every kind of request with each live key, an idempotent one among them."""
    keys = [stack.api_key, await stack.new_tenant("rest-a"), await stack.new_tenant("rest-b")]
    second = await stack.admin.post("/admin/v1/tenants/rest-a/keys", json={"name": "second"})
    keys.append(second.json()["key"])
    settings = {"request_log": True, "monthly_budget": "100.00"}
    assert (await stack.admin.patch("/admin/v1/tenants/rest-a/billing", json=settings)).is_success
    key_ids = []
    for tenant in ("default", "rest-a", "rest-b"):
        listed = (await stack.admin.get(f"/admin/v1/tenants/{tenant}/keys")).json()["data"]
        key_ids += [key["key_id"] for key in listed]
    revoked_id = (await stack.admin.get("/admin/v1/tenants/rest-b/keys")).json()["data"][0]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as http:
        for key in keys:
            auth = {"Authorization": f"Bearer {key}", "Idempotency-Key": str(uuid.uuid4())}
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            for body in ({**chat, "max_tokens": 4}, {**chat, "max_tokens": 4, "stream": True}):
                assert (await http.post("/v1/chat/completions", json=body, headers=auth)).is_success
            completion = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
            assert (await http.post("/v1/completions", json=completion, headers=auth)).is_success
            assert (await http.get("/v1/usage", headers=auth)).is_success
        revoke = await stack.admin.post(f"/admin/v1/keys/{revoked_id['key_id']}/revoke")
        assert revoke.is_success
        gone = await http.get("/v1/models", headers={"Authorization": f"Bearer {keys[2]}"})
        assert gone.status_code == 401
    return Issued(keys, key_ids)


def _files(root: Path) -> Iterator[tuple[str, bytes]]:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            yield str(path.relative_to(root)), path.read_bytes()


def _check_files(root: Path, issued: Issued, moment: str) -> bytes:
    """No secret in any file under ``root``; the registry's bytes (``tandem.db*``)."""
    leaks, registry = [], b""
    for name, content in _files(root):
        leaks += leaks_in(f"{name} ({moment})", content, issued.secrets)
        if name.startswith("tandem.db"):
            registry += content
    assert not leaks, leaks
    return registry


async def test_sqlite_files_hold_hashes_only(tmp_path: Path) -> None:
    access = AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(sqlite_path=tmp_path / "tandem.db"),
        key_touch_interval_s=0.05,  # last-used times written too
    )
    billing = BillingConfig(
        sqlite_path=tmp_path / "ledger.db", spool_dir=tmp_path / "spool", flush_interval_s=0.05
    )
    async with make_fake_stack(access=access, gateway={"billing": billing}) as stack:
        issued = await use_keys(stack)
        # While it runs: recent pages are in the WAL, not yet in the database file.
        running = _check_files(tmp_path, issued, "running")
    stopped = _check_files(tmp_path, issued, "stopped")
    for registry in (running, stopped):
        assert all(digest.encode() in registry for digest in issued.hashes)
    ledger = b"".join(content for name, content in _files(tmp_path) if name.startswith("ledger"))
    assert all(key_id.encode() in ledger for key_id in issued.key_ids)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A server of this test's own: every key in it is the gateway's."""
    with running_redis() as server:
        yield server


async def _redis_dump(url: str) -> list[tuple[str, str]]:
    """Every key of the server and its whole value as text, read by type."""
    redis = Redis.from_url(url)
    dumped = []
    try:
        async for key in redis.scan_iter(count=1000):
            kind = (await redis.type(key)).decode()
            value: Any
            if kind == "string":
                value = await redis.get(key)
            elif kind == "hash":
                value = await redis.hgetall(key)
            elif kind == "set":
                value = await redis.smembers(key)
            elif kind == "zset":
                value = await redis.zrange(key, 0, -1, withscores=True)
            elif kind == "list":
                value = await redis.lrange(key, 0, -1)
            elif kind == "stream":
                value = await redis.xrange(key)
            else:
                raise AssertionError(f"{key!r} has type {kind}, which this dump does not read")
            dumped.append((key.decode(), repr(value)))
    finally:
        await redis.aclose()
    return dumped


def _postgres_dump(url: str) -> list[tuple[str, str]]:
    """Every table of every schema but the system ones, each row as text."""
    rows = []
    with psycopg.connect(url) as conn:
        tables = conn.execute(
            "SELECT table_schema, table_name FROM information_schema.tables"
            " WHERE table_schema NOT IN ('pg_catalog', 'information_schema')"
            " AND table_type = 'BASE TABLE'"
        ).fetchall()
        for schema, table in tables:
            query = sql.SQL("SELECT * FROM {}.{}").format(
                sql.Identifier(schema), sql.Identifier(table)
            )
            rows += [(table, repr(row)) for row in conn.execute(query)]
    return rows


async def test_redis_and_postgresql_hold_hashes_only(
    tmp_path: Path, redis_server: RedisServer, postgres_server: PostgresServer
) -> None:
    database = postgres_server.create_database(f"keys_at_rest_{uuid.uuid4().hex[:8]}")
    access = AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(redis_url=redis_server.url, sqlite_path=tmp_path / "tandem.db"),
        key_touch_interval_s=0.05,
    )
    billing = BillingConfig(
        sqlite_path=tmp_path / "ledger.db",
        spool_dir=tmp_path / "spool",
        database_url=database,
        flush_interval_s=0.05,
    )
    async with make_fake_stack(access=access, gateway={"billing": billing}) as stack:
        issued = await use_keys(stack)
        await stack.admin.get("/admin/v1/billing/export", params={"from": "2000-01-01", "to": "2100-01-01"})  # fmt: skip
        in_redis = await _redis_dump(redis_server.url)
        in_postgres = _postgres_dump(database)
        _check_files(tmp_path, issued, "spool and local files")

    leaks = []
    for key, value in in_redis:
        leaks += leaks_in(f"Redis key {key}", f"{key} {value}", issued.secrets)
    for table, row in in_postgres:
        leaks += leaks_in(f"PostgreSQL table {table}", row, issued.secrets)
    assert not leaks, leaks
    redis_text = "\n".join(f"{key} {value}" for key, value in in_redis)
    assert all(digest in redis_text for digest in issued.hashes), "the registry was read"
    postgres_text = "\n".join(row for table, row in in_postgres if table == "tandem_usage")
    assert all(key_id in postgres_text for key_id in issued.key_ids), "the ledger was read"

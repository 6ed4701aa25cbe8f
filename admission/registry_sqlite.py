"""``TenantRegistry`` in a local SQLite file: the embedded default, for a single gateway host.

The file is a ``core.sqlite.SqliteFile``; its module docstring tells the lifecycle (no I/O until
``start()`` or the first call; ``aclose()`` for good), the threading (one connection, calls
serialized in worker threads) and the ``BEGIN IMMEDIATE`` writes, so a second process on the same
file (a CLI beside the gateway) waits for the write lock instead of interleaving a
read-then-write. Foreign keys are on, so deleting a tenant deletes its keys.

The schema version lives in ``PRAGMA user_version``; ``_MIGRATIONS[n]`` takes version ``n`` to
``n + 1``. A file from a newer gateway is refused rather than misread.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from admission.plan_codec import plan_from_dict, plan_to_dict
from admission.plans import Plan
from admission.quota import StoreUnavailable
from admission.registry import TenantExistsError, UnknownKeyError, UnknownTenantError
from admission.tenants import (
    ApiKey,
    IssuedKey,
    Tenant,
    display_prefix,
    hash_key,
    new_id,
    new_key_secret,
)
from core.sqlite import SqliteFile, transaction

_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE IF NOT EXISTS tenants (
            tenant_id  TEXT PRIMARY KEY,
            name       TEXT NOT NULL UNIQUE,
            plan_json  TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )""",
        """CREATE TABLE IF NOT EXISTS api_keys (
            key_id         TEXT PRIMARY KEY,
            tenant_id      TEXT NOT NULL REFERENCES tenants (tenant_id) ON DELETE CASCADE,
            name           TEXT NOT NULL,
            display_prefix TEXT NOT NULL,
            key_hash       TEXT NOT NULL UNIQUE,
            created_at     REAL NOT NULL,
            revoked_at     REAL,
            last_used_at   REAL
        )""",
        # The cascade and list_keys both look keys up by tenant.
        "CREATE INDEX IF NOT EXISTS api_keys_by_tenant ON api_keys (tenant_id, created_at)",
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)
"""The ``user_version`` this module writes and reads."""

_TENANT_COLUMNS = "t.tenant_id, t.name, t.plan_json, t.created_at, t.updated_at"
_KEY_COLUMNS = (
    "k.key_id, k.tenant_id, k.name, k.display_prefix, k.key_hash, k.created_at, k.revoked_at,"
    " k.last_used_at"
)


class SqliteTenantRegistry:
    """Tenants and keys in one SQLite file; see the module docstring for the lifecycle."""

    def __init__(self, path: Path) -> None:
        self._file = SqliteFile(
            path,
            what="tenant registry",
            migrations=_MIGRATIONS,
            unavailable=StoreUnavailable,
            pragmas=("PRAGMA foreign_keys = ON",),
        )

    async def start(self) -> None:
        """Open the file now (folders, WAL, schema); ``StoreUnavailable`` if it cannot be."""
        await self._file.start()

    async def create_tenant(self, name: str, plan: Plan) -> Tenant:
        """Create a tenant; ``TenantExistsError`` if the name is taken."""
        now = time.time()
        tenant = Tenant(new_id("ten"), name, plan, created_at=now, updated_at=now)

        def insert(conn: sqlite3.Connection) -> None:
            with transaction(conn):
                # Checked inside the write transaction rather than read off an IntegrityError,
                # whose message is not an interface.
                if conn.execute("SELECT 1 FROM tenants WHERE name = ?", (name,)).fetchone():
                    raise TenantExistsError(name)
                conn.execute(
                    "INSERT INTO tenants (tenant_id, name, plan_json, created_at, updated_at)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (tenant.tenant_id, name, _plan_json(plan), now, now),
                )

        await self._file.run(insert)
        return tenant

    async def list_tenants(self) -> list[Tenant]:
        """Every tenant, ordered by name."""

        def select(conn: sqlite3.Connection) -> list[Tenant]:
            rows = conn.execute(f"SELECT {_TENANT_COLUMNS} FROM tenants t ORDER BY t.name")
            return [_tenant(row) for row in rows]

        return await self._file.run(select)

    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        """One tenant by id."""
        return await self._file.run(lambda conn: _get_tenant(conn, "tenant_id", tenant_id))

    async def find_tenant(self, name: str) -> Tenant | None:
        """One tenant by name."""
        return await self._file.run(lambda conn: _get_tenant(conn, "name", name))

    async def update_tenant(self, tenant_id: str, plan: Plan) -> Tenant:
        """Replace a tenant's plan; ``UnknownTenantError`` if there is none."""
        now = time.time()

        def update(conn: sqlite3.Connection) -> Tenant:
            with transaction(conn):
                conn.execute(
                    "UPDATE tenants SET plan_json = ?, updated_at = ? WHERE tenant_id = ?",
                    (_plan_json(plan), now, tenant_id),
                )
                tenant = _get_tenant(conn, "tenant_id", tenant_id)
            if tenant is None:
                raise UnknownTenantError(tenant_id)
            return tenant

        return await self._file.run(update)

    async def delete_tenant(self, tenant_id: str) -> None:
        """Delete a tenant and every key of it; ``UnknownTenantError`` if there is none."""

        def delete(conn: sqlite3.Connection) -> None:
            with transaction(conn):
                # The keys go by ON DELETE CASCADE (foreign_keys is on for this connection).
                cursor = conn.execute("DELETE FROM tenants WHERE tenant_id = ?", (tenant_id,))
            if cursor.rowcount == 0:
                raise UnknownTenantError(tenant_id)

        await self._file.run(delete)

    async def issue_key(self, tenant_id: str, name: str) -> IssuedKey:
        """A new key for a tenant; ``UnknownTenantError`` if there is none."""
        plaintext = new_key_secret()
        key = ApiKey(
            key_id=new_id("key"),
            tenant_id=tenant_id,
            name=name,
            display_prefix=display_prefix(plaintext),
            key_hash=hash_key(plaintext),
            created_at=time.time(),
        )

        def insert(conn: sqlite3.Connection) -> None:
            with transaction(conn):
                if _get_tenant(conn, "tenant_id", tenant_id) is None:
                    raise UnknownTenantError(tenant_id)
                conn.execute(
                    "INSERT INTO api_keys (key_id, tenant_id, name, display_prefix, key_hash,"
                    " created_at) VALUES (?, ?, ?, ?, ?, ?)",
                    (key.key_id, tenant_id, name, key.display_prefix, key.key_hash, key.created_at),
                )

        await self._file.run(insert)
        return IssuedKey(key=key, plaintext=plaintext)

    async def list_keys(self, tenant_id: str) -> list[ApiKey]:
        """A tenant's keys, revoked ones included, oldest first (none for an unknown tenant)."""

        def select(conn: sqlite3.Connection) -> list[ApiKey]:
            rows = conn.execute(
                f"SELECT {_KEY_COLUMNS} FROM api_keys k WHERE k.tenant_id = ?"
                " ORDER BY k.created_at, k.rowid",
                (tenant_id,),
            )
            return [_key(row) for row in rows]

        return await self._file.run(select)

    async def revoke_key(self, key_id: str) -> ApiKey:
        """Revoke a key (idempotent: the first revocation time is kept);
        ``UnknownKeyError`` if there is none."""
        now = time.time()

        def revoke(conn: sqlite3.Connection) -> ApiKey:
            with transaction(conn):
                conn.execute(
                    "UPDATE api_keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL",
                    (now, key_id),
                )
                row = conn.execute(
                    f"SELECT {_KEY_COLUMNS} FROM api_keys k WHERE k.key_id = ?", (key_id,)
                ).fetchone()
            if row is None:
                raise UnknownKeyError(key_id)
            return _key(row)

        return await self._file.run(revoke)

    async def lookup_key(self, key_hash: str) -> tuple[ApiKey, Tenant] | None:
        """The key with that hash and its tenant (revoked keys included: the caller decides)."""

        def select(conn: sqlite3.Connection) -> tuple[ApiKey, Tenant] | None:
            row = conn.execute(
                f"SELECT {_KEY_COLUMNS}, {_TENANT_COLUMNS} FROM api_keys k"
                " JOIN tenants t ON t.tenant_id = k.tenant_id WHERE k.key_hash = ?",
                (key_hash,),
            ).fetchone()
            if row is None:
                return None
            return _key(row[:8]), _tenant(row[8:])

        return await self._file.run(select)

    async def touch_keys(self, last_used: dict[str, float]) -> None:
        """Record last-used times (key id -> Unix seconds), batched by the caller; a time
        never moves backwards. Unknown (deleted) keys are skipped."""
        if not last_used:
            return
        # MAX() of SQLite returns NULL when any argument is NULL, hence the COALESCE for a key
        # never used before.
        rows = [(float(at), key_id) for key_id, at in last_used.items()]

        def update(conn: sqlite3.Connection) -> None:
            with transaction(conn):
                conn.executemany(
                    "UPDATE api_keys SET last_used_at = MAX(COALESCE(last_used_at, ?1), ?1)"
                    " WHERE key_id = ?2",
                    rows,
                )

        await self._file.run(update)

    async def aclose(self) -> None:
        """Close the file; later calls raise ``StoreUnavailable``. Idempotent."""
        await self._file.aclose()


def _plan_json(plan: Plan) -> str:
    return json.dumps(plan_to_dict(plan), separators=(",", ":"))


def _get_tenant(conn: sqlite3.Connection, column: str, value: str) -> Tenant | None:
    # ``column`` is one of two literals of this module, never input.
    row = conn.execute(
        f"SELECT {_TENANT_COLUMNS} FROM tenants t WHERE t.{column} = ?", (value,)
    ).fetchone()
    return None if row is None else _tenant(row)


def _tenant(row: Sequence[Any]) -> Tenant:
    tenant_id, name, plan_json, created_at, updated_at = row
    return Tenant(tenant_id, name, plan_from_dict(json.loads(plan_json)), created_at, updated_at)


def _key(row: Sequence[Any]) -> ApiKey:
    key_id, tenant_id, name, prefix, key_hash, created_at, revoked_at, last_used_at = row
    return ApiKey(
        key_id=key_id,
        tenant_id=tenant_id,
        name=name,
        display_prefix=prefix,
        key_hash=key_hash,
        created_at=created_at,
        revoked_at=revoked_at,
        last_used_at=last_used_at,
    )

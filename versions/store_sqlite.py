"""``VersionStore`` in a local SQLite file of its own (``<state_dir>/versions.db``).

The file is a ``core.sqlite.SqliteFile``, like the tenant registry's; its module docstring tells
the lifecycle (no I/O until ``start()`` or the first call), the threading (one connection, calls
serialized in worker threads) and the ``BEGIN IMMEDIATE`` writes, so another process on the same
file (a second gateway, the CLI) waits for the write lock instead of interleaving a
read-then-write, and sees every committed change on its next read.

The audit table is append-only: triggers abort any ``UPDATE`` or ``DELETE`` of it, whoever runs
them. The policy revision is a one-row table changed in the same transaction as the policy.
The schema version lives in ``PRAGMA user_version``; ``_MIGRATIONS[n]`` takes version ``n`` to
``n + 1``; a file from a newer gateway is refused rather than misread.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import sqlite3
from pathlib import Path
from typing import Any

from admission.quota import StoreUnavailable
from core.sqlite import SqliteFile, transaction
from versions.records import AuditEntry, ModelVersion, UnknownVersionError
from versions.store import (
    already_registered,
    check_audit_query,
    check_audit_time,
    parse_ref,
    pick,
)

_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE versions (
            version_id TEXT PRIMARY KEY,
            alias      TEXT NOT NULL,
            created_at REAL NOT NULL,
            data_json  TEXT NOT NULL
        )""",
        "CREATE INDEX versions_by_alias ON versions (alias, created_at)",
        """CREATE TABLE policies (
            alias       TEXT PRIMARY KEY,
            policy_json TEXT NOT NULL
        )""",
        # One row (id 0), so reading the revision is one primary-key lookup.
        """CREATE TABLE policy_revision (
            id       INTEGER PRIMARY KEY CHECK (id = 0),
            revision INTEGER NOT NULL
        )""",
        "INSERT INTO policy_revision (id, revision) VALUES (0, 0)",
        # AUTOINCREMENT: a seq is never handed out twice, even if the last row were lost.
        """CREATE TABLE audit (
            seq         INTEGER PRIMARY KEY AUTOINCREMENT,
            at          REAL NOT NULL,
            actor       TEXT NOT NULL,
            action      TEXT NOT NULL,
            alias       TEXT,
            subject     TEXT NOT NULL,
            before_json TEXT,
            after_json  TEXT,
            reason      TEXT NOT NULL
        )""",
        "CREATE INDEX audit_by_alias ON audit (alias, seq)",
        "CREATE INDEX audit_by_time ON audit (at)",
        """CREATE TRIGGER audit_no_update BEFORE UPDATE ON audit
           BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END""",
        """CREATE TRIGGER audit_no_delete BEFORE DELETE ON audit
           BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END""",
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)
"""The ``user_version`` this module writes and reads."""

_AUDIT_FIELDS = "at, actor, action, alias, subject, before_json, after_json, reason"
_AUDIT_COLUMNS = f"seq, {_AUDIT_FIELDS}"


class SqliteVersionStore:
    """Versions, policies and the audit log in one SQLite file; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self._file = SqliteFile(
            path, what="versions store", migrations=_MIGRATIONS, unavailable=StoreUnavailable
        )

    async def start(self) -> None:
        """Open the file now (folders, WAL, schema); ``StoreUnavailable`` if it cannot be."""
        await self._file.start()

    async def aclose(self) -> None:
        """Close the file; later calls raise ``StoreUnavailable``. Idempotent."""
        await self._file.aclose()

    async def register(self, version: ModelVersion) -> tuple[ModelVersion, bool]:
        """Store ``version``; idempotent under its alias, ``VersionConflictError`` under
        another (see ``VersionStore.register``)."""

        def insert(conn: sqlite3.Connection) -> tuple[ModelVersion, bool]:
            with transaction(conn):
                row = conn.execute(
                    "SELECT data_json FROM versions WHERE version_id = ?", (version.version_id,)
                ).fetchone()
                if row is None:
                    conn.execute(
                        "INSERT INTO versions (version_id, alias, created_at, data_json)"
                        " VALUES (?, ?, ?, ?)",
                        (version.version_id, version.alias, version.created_at, _json(version)),
                    )
                    return version, True
            return already_registered(_version(row), version)

        return await self._file.run(insert)

    async def get(self, ref: str) -> ModelVersion | None:
        """The version ``ref`` names (full id, ``<alias>@<id8>``, unique id prefix)."""
        parsed = parse_ref(ref)
        if parsed is None:
            return None

        def select(conn: sqlite3.Connection) -> list[ModelVersion]:
            # Ids are lowercase hex (parse_ref checked): no LIKE wildcard in the prefix. Two rows
            # are enough to tell an ambiguous prefix.
            rows = conn.execute(
                "SELECT data_json FROM versions WHERE version_id LIKE ? LIMIT 2",
                (parsed.id_prefix + "%",),
            )
            return [_version(row) for row in rows]

        return pick(parsed, await self._file.run(select))

    async def list(self, alias: str | None = None) -> builtins.list[ModelVersion]:
        """Every version (of ``alias``, if given), oldest first."""

        def select(conn: sqlite3.Connection) -> list[ModelVersion]:
            # Ties by id: the order Redis's sorted sets give, so both stores list alike.
            rows = conn.execute(
                "SELECT data_json FROM versions WHERE ?1 IS NULL OR alias = ?1"
                " ORDER BY created_at, version_id",
                (alias,),
            )
            return [_version(row) for row in rows]

        return await self._file.run(select)

    async def delete(self, version_id: str) -> ModelVersion:
        """Remove a version, returning it; ``UnknownVersionError`` if there is none."""

        def remove(conn: sqlite3.Connection) -> ModelVersion:
            # Read and delete in one write transaction, without RETURNING (SQLite 3.35+).
            with transaction(conn):
                row = conn.execute(
                    "SELECT data_json FROM versions WHERE version_id = ?", (version_id,)
                ).fetchone()
                conn.execute("DELETE FROM versions WHERE version_id = ?", (version_id,))
            if row is None:
                raise UnknownVersionError(f"no model version {version_id!r}")
            return _version(row)

        return await self._file.run(remove)

    async def get_policy(self, alias: str) -> dict[str, Any] | None:
        """The traffic policy of ``alias``, if one is set."""

        def select(conn: sqlite3.Connection) -> dict[str, Any] | None:
            row = conn.execute(
                "SELECT policy_json FROM policies WHERE alias = ?", (alias,)
            ).fetchone()
            return None if row is None else _object(row[0])

        return await self._file.run(select)

    async def list_policies(self) -> dict[str, dict[str, Any]]:
        """Every traffic policy, by alias."""

        def select(conn: sqlite3.Connection) -> dict[str, dict[str, Any]]:
            rows = conn.execute("SELECT alias, policy_json FROM policies ORDER BY alias")
            return {alias: _object(blob) for alias, blob in rows}

        return await self._file.run(select)

    async def put_policy(self, alias: str, policy: dict[str, Any]) -> int:
        """Set the traffic policy of ``alias``; the new policy revision."""
        blob = json.dumps(policy, separators=(",", ":"))

        def upsert(conn: sqlite3.Connection) -> int:
            with transaction(conn):
                conn.execute(
                    "INSERT INTO policies (alias, policy_json) VALUES (?, ?)"
                    " ON CONFLICT (alias) DO UPDATE SET policy_json = excluded.policy_json",
                    (alias, blob),
                )
                return _bump_revision(conn)

        return await self._file.run(upsert)

    async def delete_policy(self, alias: str) -> bool:
        """Remove the traffic policy of ``alias``; False if it had none."""

        def remove(conn: sqlite3.Connection) -> bool:
            with transaction(conn):
                cursor = conn.execute("DELETE FROM policies WHERE alias = ?", (alias,))
                if cursor.rowcount == 0:
                    return False
                _bump_revision(conn)
                return True

        return await self._file.run(remove)

    async def policy_revision(self) -> int:
        """The policy revision (0: policies never changed). One primary-key read."""

        def select(conn: sqlite3.Connection) -> int:
            (revision,) = conn.execute(
                "SELECT revision FROM policy_revision WHERE id = 0"
            ).fetchone()
            return int(revision)

        return await self._file.run(select)

    async def append_audit(self, entry: AuditEntry) -> AuditEntry:
        """Append ``entry``; the stored entry with its ``seq`` and ``at`` (never before the
        previous entry's)."""
        check_audit_time(entry)

        def insert(conn: sqlite3.Connection) -> AuditEntry:
            with transaction(conn):
                # Inside the write lock: no entry can be appended between this read and ours.
                (last_at,) = conn.execute("SELECT MAX(at) FROM audit").fetchone()
                at = entry.at if last_at is None else max(entry.at, last_at)
                values = (
                    at, entry.actor, entry.action, entry.alias, entry.subject,
                    _optional_json(entry.before), _optional_json(entry.after), entry.reason,
                )  # fmt: skip
                seq = conn.execute(
                    f"INSERT INTO audit ({_AUDIT_FIELDS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    values,
                ).lastrowid
            if seq is None:  # never after an INSERT; it keeps the type a plain int
                raise StoreUnavailable(f"versions store {self._file.path}: no seq for the entry")
            return dataclasses.replace(entry, seq=seq, at=at)

        return await self._file.run(insert)

    async def audit(
        self,
        *,
        alias: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 1000,
    ) -> builtins.list[AuditEntry]:
        """Up to ``limit`` entries, oldest first, filtered by alias and ``[since, until)``."""
        check_audit_query(since, until, limit)

        def select(conn: sqlite3.Connection) -> list[AuditEntry]:
            # ``at`` never decreases along ``seq`` (append_audit), so seq order is time order.
            rows = conn.execute(
                f"SELECT {_AUDIT_COLUMNS} FROM audit WHERE (?1 IS NULL OR alias = ?1)"
                " AND (?2 IS NULL OR at >= ?2) AND (?3 IS NULL OR at < ?3)"
                " ORDER BY seq LIMIT ?4",
                (alias, since, until, limit),
            )
            return [_audit_entry(row) for row in rows]

        return await self._file.run(select)


def _bump_revision(conn: sqlite3.Connection) -> int:
    conn.execute("UPDATE policy_revision SET revision = revision + 1 WHERE id = 0")
    (revision,) = conn.execute("SELECT revision FROM policy_revision WHERE id = 0").fetchone()
    return int(revision)


def _json(version: ModelVersion) -> str:
    return json.dumps(version.to_dict(), separators=(",", ":"))


def _version(row: tuple[Any, ...]) -> ModelVersion:
    return ModelVersion.from_dict(json.loads(row[0]))


def _object(blob: str) -> dict[str, Any]:
    value = json.loads(blob)
    if not isinstance(value, dict):
        raise ValueError(f"stored JSON is not an object: {blob[:80]!r}")
    return value


def _optional_json(value: dict[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def _audit_entry(row: tuple[Any, ...]) -> AuditEntry:
    seq, at, actor, action, alias, subject, before_json, after_json, reason = row
    before = None if before_json is None else _object(before_json)
    after = None if after_json is None else _object(after_json)
    return AuditEntry(seq, at, actor, action, alias, subject, before, after, reason)

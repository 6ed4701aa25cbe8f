"""``RolloutStore`` in a local SQLite file of its own (``<state_dir>/rollouts.db``).

The file is a ``core.sqlite.SqliteFile``; its module docstring tells the lifecycle (no I/O until
``start()`` or the first call), the threading (one connection, calls serialized in a worker
thread) and the ``BEGIN IMMEDIATE`` writes, so another process on the same file (a second
gateway, the CLI) waits for the write lock instead of interleaving a read-then-write.

Tables: ``rollouts`` (the record as JSON, beside the columns a query needs), ``commands`` (one
row per command, keyed by rollout and seq) and ``fence``, one row holding the highest fencing
token any save has used, checked and raised in the same transaction as the save. The schema
version lives in ``PRAGMA user_version``; ``_MIGRATIONS[n]`` takes version ``n`` to ``n + 1``.
The file belongs to this store alone: another ``SqliteFile`` with its own migrations (the
lease's) would fight over ``user_version``.
"""

from __future__ import annotations

import builtins
import sqlite3
from pathlib import Path
from typing import Any

from admission.quota import StoreUnavailable
from core.sqlite import SqliteFile, transaction
from rollouts.store import (
    ACTIVE_STATUSES,
    active_conflict,
    alias_changed,
    check_count,
    check_fence,
    dump,
    fenced_out,
    id_taken,
    load,
    record_keys,
    unknown,
)

_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE rollouts (
            id         TEXT PRIMARY KEY,
            alias      TEXT NOT NULL,
            status     TEXT NOT NULL,
            created_at REAL NOT NULL,
            data_json  TEXT NOT NULL
        )""",
        "CREATE INDEX rollouts_by_alias ON rollouts (alias, status)",
        "CREATE INDEX rollouts_by_time ON rollouts (created_at, id)",
        """CREATE TABLE commands (
            rollout_id TEXT NOT NULL,
            seq        INTEGER NOT NULL,
            data_json  TEXT NOT NULL,
            PRIMARY KEY (rollout_id, seq)
        )""",
        # One row (id 0), so reading the fence is one primary-key lookup.
        """CREATE TABLE fence (
            id      INTEGER PRIMARY KEY CHECK (id = 0),
            highest INTEGER NOT NULL
        )""",
        "INSERT INTO fence (id, highest) VALUES (0, 0)",
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)
"""The ``user_version`` this module writes and reads."""

# Bound as parameters, in this order, wherever a query asks for active statuses.
_ACTIVE = tuple(sorted(ACTIVE_STATUSES))
_ACTIVE_IN = f"({', '.join('?' * len(_ACTIVE))})"


class SqliteRolloutStore:
    """Rollouts, their commands and the fence in one SQLite file; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self._file = SqliteFile(
            path, what="rollout store", migrations=_MIGRATIONS, unavailable=StoreUnavailable
        )

    async def start(self) -> None:
        """Open the file now (folders, WAL, schema); ``StoreUnavailable`` if it cannot be."""
        await self._file.start()

    async def aclose(self) -> None:
        """Close the file; later calls raise ``StoreUnavailable``. Idempotent."""
        await self._file.aclose()

    async def create(self, record: dict[str, Any]) -> None:
        """Store a new rollout; ``RolloutConflictError`` if its alias has an active one or its
        id is taken."""
        keys = record_keys(record)
        blob = dump(record)

        def insert(conn: sqlite3.Connection) -> None:
            with transaction(conn):
                active_id = _active_id(conn, keys.alias)
                if active_id is not None:
                    raise active_conflict(keys.alias, active_id)
                if _stored(conn, keys.id) is not None:
                    raise id_taken(keys.id)
                conn.execute(
                    "INSERT INTO rollouts (id, alias, status, created_at, data_json)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (keys.id, keys.alias, keys.status, keys.created_at, blob),
                )

        await self._file.run(insert)

    async def get(self, rollout_id: str) -> dict[str, Any] | None:
        """The record of ``rollout_id``, if there is one."""

        def select(conn: sqlite3.Connection) -> dict[str, Any] | None:
            row = conn.execute(
                "SELECT data_json FROM rollouts WHERE id = ?", (rollout_id,)
            ).fetchone()
            return None if row is None else load(row[0])

        return await self._file.run(select)

    async def list(
        self, *, alias: str | None = None, active: bool | None = None, limit: int = 100
    ) -> builtins.list[dict[str, Any]]:
        """Up to ``limit`` records, newest first, of ``alias`` and active or finished if
        asked."""
        check_count("limit", limit)
        status = "" if active is None else f" AND status {'' if active else 'NOT '}IN {_ACTIVE_IN}"
        statuses = () if active is None else _ACTIVE

        def select(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            # Ties by id, descending: the order Redis's ZRANGE ... REV gives.
            rows = conn.execute(
                f"SELECT data_json FROM rollouts WHERE (? IS NULL OR alias = ?){status}"
                " ORDER BY created_at DESC, id DESC LIMIT ?",
                (alias, alias, *statuses, limit),
            )
            return [load(blob) for (blob,) in rows]

        return await self._file.run(select)

    async def save(self, record: dict[str, Any], fence: int) -> None:
        """Replace the stored record if ``fence`` is not stale; see ``RolloutStore.save``."""
        keys = record_keys(record)
        check_fence(fence)
        blob = dump(record)

        def update(conn: sqlite3.Connection) -> None:
            with transaction(conn):
                (highest,) = conn.execute("SELECT highest FROM fence WHERE id = 0").fetchone()
                if fence < highest:
                    raise fenced_out(fence, highest)
                stored_alias = _stored(conn, keys.id)
                if stored_alias is None:
                    raise unknown(keys.id)
                if stored_alias != keys.alias:
                    raise alias_changed(keys.id, stored_alias, keys.alias)
                active_id = _active_id(conn, keys.alias)
                if keys.active and active_id not in (None, keys.id):
                    raise active_conflict(keys.alias, str(active_id))
                conn.execute("UPDATE fence SET highest = ? WHERE id = 0", (fence,))
                # created_at stays the first one: a rollout keeps its place in the listings.
                conn.execute(
                    "UPDATE rollouts SET status = ?, data_json = ? WHERE id = ?",
                    (keys.status, blob, keys.id),
                )

        await self._file.run(update)

    async def advance_fence(self, fence: int) -> None:
        """Raise the highest fence to ``fence``; see ``RolloutStore.advance_fence``."""
        check_fence(fence)

        def advance(conn: sqlite3.Connection) -> None:
            with transaction(conn):
                conn.execute("UPDATE fence SET highest = MAX(highest, ?) WHERE id = 0", (fence,))

        await self._file.run(advance)

    async def push_command(self, rollout_id: str, command: dict[str, Any]) -> int:
        """Append ``command`` to the rollout's log; its seq. ``UnknownRolloutError`` if there
        is no such rollout."""
        blob = dump(command)

        def insert(conn: sqlite3.Connection) -> int:
            with transaction(conn):
                # Inside the write lock: no command can take this seq between read and insert.
                if _stored(conn, rollout_id) is None:
                    raise unknown(rollout_id)
                (seq,) = conn.execute(
                    "SELECT COALESCE(MAX(seq), 0) + 1 FROM commands WHERE rollout_id = ?",
                    (rollout_id,),
                ).fetchone()
                conn.execute(
                    "INSERT INTO commands (rollout_id, seq, data_json) VALUES (?, ?, ?)",
                    (rollout_id, seq, blob),
                )
            return int(seq)

        return await self._file.run(insert)

    async def commands(
        self, rollout_id: str, after_seq: int = 0
    ) -> builtins.list[tuple[int, dict[str, Any]]]:
        """The rollout's commands with seq greater than ``after_seq``, oldest first."""
        check_count("after_seq", after_seq)

        def select(conn: sqlite3.Connection) -> list[tuple[int, dict[str, Any]]]:
            rows = conn.execute(
                "SELECT seq, data_json FROM commands WHERE rollout_id = ? AND seq > ? ORDER BY seq",
                (rollout_id, after_seq),
            )
            return [(int(seq), load(blob)) for seq, blob in rows]

        return await self._file.run(select)


def _stored(conn: sqlite3.Connection, rollout_id: str) -> str | None:
    """The alias of the stored rollout ``rollout_id``; None if there is none."""
    row = conn.execute("SELECT alias FROM rollouts WHERE id = ?", (rollout_id,)).fetchone()
    return None if row is None else str(row[0])


def _active_id(conn: sqlite3.Connection, alias: str) -> str | None:
    """The id of the active rollout of ``alias``, if there is one (never more than one)."""
    row = conn.execute(
        f"SELECT id FROM rollouts WHERE alias = ? AND status IN {_ACTIVE_IN} LIMIT 1",
        (alias, *_ACTIVE),
    ).fetchone()
    return None if row is None else str(row[0])

"""``core.sqlite.SqliteFile`` on real files: migrations, the unavailable error, transactions.

The stores built on it (tenant registry, versions store) test their own behaviour over it.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from core.sqlite import SqliteFile, transaction

_V1 = ("CREATE TABLE items (name TEXT PRIMARY KEY)",)
_V2 = ("ALTER TABLE items ADD COLUMN size INTEGER NOT NULL DEFAULT 0",)


class Unavailable(Exception):
    """The store's own error, as the stores pass ``StoreUnavailable``."""


def _file(path: Path, *migrations: tuple[str, ...], pragmas: tuple[str, ...] = ()) -> SqliteFile:
    return SqliteFile(
        path, what="test store", migrations=migrations, unavailable=Unavailable, pragmas=pragmas
    )


def _insert(conn: sqlite3.Connection, name: str) -> None:
    with transaction(conn):
        conn.execute("INSERT INTO items (name) VALUES (?)", (name,))


def _names(conn: sqlite3.Connection) -> list[str]:
    return [name for (name,) in conn.execute("SELECT name FROM items ORDER BY name")]


async def test_migrates_only_the_steps_a_file_lacks(tmp_path: Path) -> None:
    path = tmp_path / "a" / "store.db"
    old = _file(path, _V1)
    await old.run(lambda conn: _insert(conn, "kept"))
    await old.aclose()

    new = _file(path, _V1, _V2)  # rerunning _V1's CREATE TABLE would fail
    try:
        rows = await new.run(lambda conn: conn.execute("SELECT name, size FROM items").fetchall())
        (version,) = await new.run(lambda conn: conn.execute("PRAGMA user_version").fetchone())
    finally:
        await new.aclose()
    assert rows == [("kept", 0)]
    assert version == new.schema_version == 2


async def test_a_newer_file_is_refused_with_the_given_error(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    newer = _file(path, _V1, _V2)
    await newer.start()
    await newer.aclose()

    older = _file(path, _V1)
    with pytest.raises(Unavailable, match=r"^test store .* schema version 2, newer than .* 1"):
        await older.start()
    await older.aclose()


async def test_pragmas_run_on_the_connection(tmp_path: Path) -> None:
    file = _file(tmp_path / "store.db", _V1, pragmas=("PRAGMA foreign_keys = ON",))
    try:
        (foreign_keys,) = await file.run(
            lambda conn: conn.execute("PRAGMA foreign_keys").fetchone()
        )
    finally:
        await file.aclose()
    assert foreign_keys == 1


async def test_sqlite_errors_become_the_given_error_but_bugs_do_not(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    unusable = _file(a_file / "store.db", _V1)
    with pytest.raises(Unavailable, match=r"^test store .*store\.db: ") as caught:
        await unusable.start()
    assert isinstance(caught.value.__cause__, sqlite3.Error | OSError)
    await unusable.aclose()

    file = _file(tmp_path / "store.db", _V1)
    try:
        await file.run(lambda conn: _insert(conn, "one"))
        with pytest.raises(sqlite3.IntegrityError):  # a duplicate key is the store's bug
            await file.run(lambda conn: _insert(conn, "one"))
        with pytest.raises(Unavailable):
            await file.run(lambda conn: conn.execute("SELECT * FROM no_such_table"))
    finally:
        await file.aclose()


async def test_a_failed_transaction_rolls_back(tmp_path: Path) -> None:
    def insert_then_fail(conn: sqlite3.Connection) -> None:
        with transaction(conn):
            conn.execute("INSERT INTO items (name) VALUES ('lost')")
            raise ValueError("abandoned")

    file = _file(tmp_path / "store.db", _V1)
    try:
        with pytest.raises(ValueError, match="abandoned"):
            await file.run(insert_then_fail)
        assert await file.run(_names) == []
        await file.run(lambda conn: _insert(conn, "next"))  # no transaction was left open
        assert await file.run(_names) == ["next"]
    finally:
        await file.aclose()


async def test_calls_after_close_are_refused(tmp_path: Path) -> None:
    file = _file(tmp_path / "store.db", _V1)
    await file.start()
    await file.aclose()
    await file.aclose()  # idempotent
    with pytest.raises(Unavailable, match="closed"):
        await file.run(_names)


async def test_calls_are_serialized_on_one_connection(tmp_path: Path) -> None:
    # Each call holds the connection a while; without the lock the worker threads overlap.
    guard = threading.Lock()
    active = most = 0

    def occupy(conn: sqlite3.Connection) -> None:
        nonlocal active, most
        with guard:
            active += 1
            most = max(most, active)
        conn.execute("SELECT COUNT(*) FROM items").fetchone()
        time.sleep(0.005)
        with guard:
            active -= 1

    file = _file(tmp_path / "store.db", _V1)
    try:
        await asyncio.gather(*(file.run(occupy) for _ in range(8)))
    finally:
        await file.aclose()
    assert most == 1


async def test_calls_do_not_wait_for_the_loops_shared_threads(tmp_path: Path) -> None:
    # Every thread of the loop's default pool busy (as when other blocking work holds them):
    # a store call (a key lookup before admission) still runs, on the file's own thread.
    sqlite_file = _file(tmp_path / "own.db", _V1)
    loop = asyncio.get_running_loop()
    release = threading.Event()
    busy = [loop.run_in_executor(None, release.wait) for _ in range(64)]  # more than it has
    try:
        await asyncio.wait_for(sqlite_file.run(lambda conn: _insert(conn, "a")), 5)
        assert await asyncio.wait_for(sqlite_file.run(_names), 5) == ["a"]
    finally:
        release.set()
        await asyncio.gather(*busy)
        await sqlite_file.aclose()

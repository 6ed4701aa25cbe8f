"""Ledger stores for the billing tests: the same test runs on SQLite (a file in ``tmp_path``) and on
PostgreSQL (a fresh database on the session's real server), so both backends are held to the
same behaviour."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from billing.sql_store import PostgresLedgerStore, SqliteLedgerStore, SqlLedgerStore

if TYPE_CHECKING:
    from tests.postgres_server import PostgresServer

BACKENDS = ("sqlite", "postgres")

StoreFactory = Callable[[], SqlLedgerStore]
"""A new store on the test's database (another process or gateway on the same ledger); not
migrated: call ``migrate()`` when it plays a fresh start."""


class LedgerDatabase:
    """One empty ledger database of a backend; every store opened on it is closed at teardown."""

    def __init__(self, backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        self.backend = backend
        self._stores: list[SqlLedgerStore] = []
        if backend == "sqlite":
            self.sqlite_path: Path | None = tmp_path / f"ledger-{uuid.uuid4().hex[:8]}.db"
            self.url: str | None = None
        elif backend == "postgres":
            # Asked for only here: the SQLite runs never start a PostgreSQL server.
            server: PostgresServer = request.getfixturevalue("postgres_server")
            self.sqlite_path = None
            self.url = server.create_database(f"ledger_{uuid.uuid4().hex[:16]}")
        else:
            raise ValueError(f"unknown backend {backend!r}")

    def open(self) -> SqlLedgerStore:
        store: SqlLedgerStore
        if self.sqlite_path is not None:
            store = SqliteLedgerStore(self.sqlite_path)
        else:
            assert self.url is not None
            store = PostgresLedgerStore(self.url)
        self._stores.append(store)
        return store

    def query(self, statement: str) -> list[tuple[Any, ...]]:
        """Rows of one statement on a connection of its own (to look under the store)."""
        if self.sqlite_path is not None:
            connection = sqlite3.connect(self.sqlite_path)
            try:
                return [tuple(row) for row in connection.execute(statement).fetchall()]
            finally:
                connection.close()
        assert self.url is not None
        with psycopg.connect(self.url) as pg_connection:
            return [tuple(row) for row in pg_connection.execute(statement).fetchall()]

    def close(self) -> None:
        for store in self._stores:
            store.close()


@pytest.fixture
def ledger_database_factory(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[str], LedgerDatabase]]:
    """``factory(backend)``: a new empty database of that backend (a test comparing both)."""
    databases: list[LedgerDatabase] = []

    def factory(backend: str) -> LedgerDatabase:
        database = LedgerDatabase(backend, tmp_path, request)
        databases.append(database)
        return database

    yield factory
    for database in databases:
        database.close()


@pytest.fixture(params=BACKENDS)
def ledger_database(
    request: pytest.FixtureRequest, ledger_database_factory: Callable[[str], LedgerDatabase]
) -> LedgerDatabase:
    """An empty ledger database, once per backend."""
    return ledger_database_factory(request.param)


@pytest.fixture
def ledger_store(ledger_database: LedgerDatabase) -> SqlLedgerStore:
    """A migrated store on an empty database, once per backend; closed after the test."""
    store = ledger_database.open()
    store.migrate()
    return store


@pytest.fixture
def store_factory(ledger_database: LedgerDatabase, ledger_store: SqlLedgerStore) -> StoreFactory:
    """New stores on ``ledger_store``'s database (a restarted gateway, a second gateway)."""
    del ledger_store  # requested so the schema exists before any factory store is opened
    return ledger_database.open

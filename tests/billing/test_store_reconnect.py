"""A PostgreSQL ledger store survives a database restart without failing a call: a connection
left idle is checked before use and replaced when the server closed it."""

from __future__ import annotations

import uuid

import pytest

import billing.sql_store
from billing.sql_store import PostgresLedgerStore
from billing.store import LedgerUnavailableError, UsageQuery
from tests.postgres_server import PostgresServer

QUERY = UsageQuery(0, 2**62)


def test_the_first_call_after_a_restart_reconnects(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PostgresLedgerStore(postgres_server.create_database(f"re_{uuid.uuid4().hex[:8]}"))
    try:
        store.migrate()
        assert store.count_usage(QUERY) == (0, 0)
        postgres_server.stop()
        postgres_server.start()
        # Checked at once instead of after a second idle: the same path, without sleeping.
        monkeypatch.setattr(billing.sql_store, "_CHECK_AFTER_IDLE_S", -1.0)
        assert store.count_usage(QUERY) == (0, 0)
    finally:
        store.close()


def test_without_the_check_the_stale_connection_fails_once(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the check prevents (and that the restart really closes the connection).
    monkeypatch.setattr(billing.sql_store, "_CHECK_AFTER_IDLE_S", float("inf"))
    store = PostgresLedgerStore(postgres_server.create_database(f"re_{uuid.uuid4().hex[:8]}"))
    try:
        store.migrate()
        postgres_server.stop()
        postgres_server.start()
        with pytest.raises(LedgerUnavailableError):
            store.count_usage(QUERY)
        assert store.count_usage(QUERY) == (0, 0)  # reconnected
    finally:
        store.close()

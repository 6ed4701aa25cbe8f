"""The ``postgres_server`` fixture: a real server, an outage that keeps the data, and isolated
databases per test."""

from __future__ import annotations

import psycopg
import pytest

from tests.postgres_server import PostgresServer


def test_connects_and_answers(postgres_server: PostgresServer) -> None:
    with psycopg.connect(postgres_server.url) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
        assert conn.execute("select current_user").fetchone() == ("tandem",)
        assert conn.execute("show server_encoding").fetchone() == ("UTF8",)
        assert conn.execute("show fsync").fetchone() == ("off",)


def test_data_survives_stop_and_start(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("survives_outage")
    with psycopg.connect(url) as conn:
        conn.execute("create table ledger (id int primary key, amount bigint not null)")
        conn.execute("insert into ledger values (1, 100), (2, 250)")
    port = postgres_server.port

    postgres_server.stop()
    try:
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(url, connect_timeout=2)
    finally:
        postgres_server.start()

    assert postgres_server.port == port
    with psycopg.connect(url) as conn:
        assert conn.execute("select id, amount from ledger order by id").fetchall() == [
            (1, 100),
            (2, 250),
        ]


def test_stop_drops_open_connections(postgres_server: PostgresServer) -> None:
    with psycopg.connect(postgres_server.url) as conn:
        conn.execute("select 1")
        postgres_server.stop()
        try:
            with pytest.raises(psycopg.OperationalError):
                conn.execute("select 1")
            with pytest.raises(psycopg.OperationalError):
                psycopg.connect(postgres_server.url, connect_timeout=2)
        finally:
            postgres_server.start()
    with psycopg.connect(postgres_server.url) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_create_database_is_isolated_and_empty(postgres_server: PostgresServer) -> None:
    first = postgres_server.create_database("isolated_first")
    second = postgres_server.create_database("isolated_second")
    assert first != second
    with psycopg.connect(first) as conn:
        conn.execute("create table only_here (x int)")
        conn.execute("insert into only_here values (1)")
    tables = "select count(*) from pg_tables where schemaname = 'public'"
    with psycopg.connect(second) as conn:
        assert conn.execute("select current_database()").fetchone() == ("isolated_second",)
        assert conn.execute(tables).fetchone() == (0,)
    with psycopg.connect(first) as conn:
        assert conn.execute(tables).fetchone() == (1,)
    with pytest.raises(psycopg.errors.DuplicateDatabase):
        postgres_server.create_database("isolated_first")

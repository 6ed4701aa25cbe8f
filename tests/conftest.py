"""Fixtures every test package may use. Loaded by every test: keep it light (nothing starts
until a test asks for it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.redis_server import running_redis

if TYPE_CHECKING:
    from tests.postgres_server import PostgresServer


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real ``redis-server`` shared by the session; tests keep apart by key prefix."""
    with running_redis() as server:
        yield server.url


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A real PostgreSQL server shared by the session; tests keep apart by database
    (``postgres_server.create_database(name)``). A test that calls ``stop()`` must ``start()``
    it again. Fails (never skips) when PostgreSQL is not installed: run ``scripts/install --dev``.
    """
    from tests.postgres_server import running_postgres  # imports psycopg: only when asked for

    with running_postgres() as server:
        yield server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the end-to-end tier last. Its vLLM workers boot once and live to the end of the
    session, each keeping a core busy (NIXL's UCX progress thread spins even when idle, issue 4):
    the load tests of the fast tiers must not share this 2-core machine with them."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)  # stable

"""Fixtures every test package may use. Loaded by every test: keep it light (nothing starts
until a test asks for it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import running_redis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real ``redis-server`` shared by the session; tests keep apart by key prefix."""
    with running_redis() as server:
        yield server.url

"""One store suite over both backends: the embedded SQLite file and a real Redis. A ``Backend``
opens instances of the store under test (two act like two replicas); ``sqlite_or_redis`` makes
the one a ``params=["sqlite", "redis"]`` fixture asks for and closes every instance after the
test, deleting the test's Redis keys (each test has a prefix of its own: no flush)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar
from uuid import uuid4

import pytest
from redis.asyncio import Redis


class ClosableStore(Protocol):
    async def aclose(self) -> None: ...


S = TypeVar("S", bound=ClosableStore)


@dataclass
class Backend(Generic[S]):
    """One store and how to open more instances over it (two act like two replicas)."""

    name: str
    open_store: Callable[[], S]
    opened: list[S] = field(default_factory=list)

    def make(self) -> S:
        store = self.open_store()
        self.opened.append(store)
        return store


@asynccontextmanager
async def sqlite_or_redis(
    request: pytest.FixtureRequest,
    open_sqlite: Callable[[], S],
    open_redis: Callable[[str, str], S],
) -> AsyncIterator[Backend[S]]:
    """``request.param``'s backend: ``open_sqlite()``, or ``open_redis(url, key_prefix)``."""
    if request.param == "sqlite":
        backend = Backend("sqlite", open_sqlite)
        try:
            yield backend
        finally:
            for store in backend.opened:
                await store.aclose()
        return

    url: str = request.getfixturevalue("redis_url")
    prefix = f"test:{uuid4().hex}:"
    backend = Backend("redis", lambda: open_redis(url, prefix))
    try:
        yield backend
    finally:
        for store in backend.opened:
            await store.aclose()
        await delete_keys(url, prefix)


async def delete_keys(url: str, prefix: str) -> None:
    """Delete a test's Redis keys (those under its ``prefix``), leaving other tests' alone."""
    raw = Redis.from_url(url)
    stale = [key async for key in raw.scan_iter(match=f"{prefix}*")]
    if stale:
        await raw.delete(*stale)
    await raw.aclose()

"""Both rollout leases, one suite: ``SqliteLease`` on a temporary file with a fake clock, and
``RedisLease`` on a real ``redis-server`` (one key prefix per test) where expiry is the
server's own, so its tests sleep past a short ttl. Two lease objects over one store act as two
gateways."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from uuid import uuid4

import pytest

from admission.quota import StoreUnavailable
from rollouts.lease import Lease, RedisLease, SqliteLease
from rollouts.store import FencedOutError
from rollouts.store_sqlite import SqliteRolloutStore
from tests.store_backends import delete_keys

TTL_S = 0.5


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Backend:
    """Lease objects over one store, and how to let a ttl run out."""

    name: str
    open_lease: Callable[[], Lease]
    pass_time: Callable[[float], Awaitable[None]]
    opened: list[Lease] = field(default_factory=list)

    def make(self) -> Lease:
        lease = self.open_lease()
        self.opened.append(lease)
        return lease


@pytest.fixture(params=["sqlite", "redis"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "sqlite":
        clock = FakeClock()

        async def advance(seconds: float) -> None:
            clock.now += seconds

        path = tmp_path / "state" / "lease.db"
        backend = Backend("sqlite", lambda: SqliteLease(path, clock=clock), advance)
        yield backend
        for lease in backend.opened:
            await lease.aclose()
        return

    url: str = request.getfixturevalue("redis_url")
    prefix = f"t{uuid4().hex}:"
    backend = Backend("redis", lambda: RedisLease(url, key_prefix=prefix), asyncio.sleep)
    yield backend
    for lease in backend.opened:
        await lease.aclose()
    await delete_keys(url, prefix)


async def test_acquire_renew_and_refuse_another_holder(backend: Backend) -> None:
    one, two = backend.make(), backend.make()
    assert await one.holder() is None
    token = await one.acquire("gw-a", TTL_S)
    assert token is not None
    assert await two.holder() == ("gw-a", token)
    assert await two.acquire("gw-b", TTL_S) is None

    # Renewing well inside the ttl, past the first ttl in all: same token, still held.
    for _ in range(3):
        await backend.pass_time(TTL_S / 2)
        assert await one.acquire("gw-a", TTL_S) == token
        assert await two.acquire("gw-b", TTL_S) is None
    assert await one.holder() == ("gw-a", token)


async def test_expiry_lets_another_acquire_with_a_greater_token(backend: Backend) -> None:
    one, two = backend.make(), backend.make()
    first = await one.acquire("gw-a", TTL_S)
    assert first is not None
    await backend.pass_time(TTL_S + 0.1)
    assert await two.holder() is None
    second = await two.acquire("gw-b", TTL_S)
    assert second is not None and second > first
    assert await one.holder() == ("gw-b", second)
    assert await one.acquire("gw-a", TTL_S) is None

    # The same holder after expiry is a new acquisition too.
    await backend.pass_time(TTL_S + 0.1)
    third = await two.acquire("gw-b", TTL_S)
    assert third is not None and third > second


async def test_release_frees_the_lease_at_once(backend: Backend) -> None:
    one, two = backend.make(), backend.make()
    first = await one.acquire("gw-a", 60.0)
    assert first is not None
    await two.release("gw-b")  # not the holder: nothing happens
    assert await two.holder() == ("gw-a", first)
    await one.release("gw-a")
    assert await two.holder() is None
    second = await two.acquire("gw-b", 60.0)
    assert second is not None and second > first
    await one.release("gw-a")  # no longer the holder: nothing happens
    assert await one.holder() == ("gw-b", second)


async def test_only_one_of_racing_gateways_acquires(backend: Backend) -> None:
    leases = [backend.make() for _ in range(5)]
    tokens = await asyncio.gather(
        *(lease.acquire(f"gw-{n}", 60.0) for n, lease in enumerate(leases))
    )
    winners = [n for n, token in enumerate(tokens) if token is not None]
    assert len(winners) == 1
    assert await leases[0].holder() == (f"gw-{winners[0]}", tokens[winners[0]])


async def test_holder_and_ttl_are_checked(backend: Backend) -> None:
    lease = backend.make()
    for ttl_s in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="ttl_s"):
            await lease.acquire("gw-a", ttl_s)
    with pytest.raises(ValueError, match="holder"):
        await lease.acquire("", 1.0)
    assert await lease.holder() is None


async def test_lease_tokens_fence_the_store(tmp_path: Path) -> None:
    """The lease's tokens and the store's fence together: the holder that lost the lease can
    no longer save."""
    clock = FakeClock()
    lease = SqliteLease(tmp_path / "lease.db", clock=clock)
    store = SqliteRolloutStore(tmp_path / "rollouts.db")
    record = {"id": "r1", "alias": "llama", "status": "running", "created_at": 1.0}
    try:
        await store.create(record)
        old = await lease.acquire("gw-a", 10.0)
        assert old is not None
        await store.save(record, old)
        clock.now += 11.0  # gw-a stalls past its ttl
        new = await lease.acquire("gw-b", 10.0)
        assert new is not None
        await store.save({**record, "status": "paused"}, new)
        with pytest.raises(FencedOutError):
            await store.save(record, old)
        assert (await store.get("r1") or {})["status"] == "paused"
    finally:
        await lease.aclose()
        await store.aclose()


async def test_sqlite_lease_keeps_counting_across_reopening(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "lease.db"
    lease = SqliteLease(path, clock=clock)
    first = await lease.acquire("gw-a", 1.0)
    await lease.release("gw-a")
    await lease.aclose()
    with pytest.raises(StoreUnavailable, match="closed"):
        await lease.holder()

    lease = SqliteLease(path, clock=clock)
    try:
        second = await lease.acquire("gw-a", 1.0)
        assert first is not None and second == first + 1
        # Another name is another lease, with its own tokens, in the same file.
        other = SqliteLease(path, name="planner", clock=clock)
        assert await other.acquire("gw-b", 1.0) == 1
        await other.aclose()
    finally:
        await lease.aclose()


async def test_redis_lease_unreachable_is_store_unavailable() -> None:
    lease = RedisLease("redis://127.0.0.1:1/0", timeout_s=0.2)
    calls: list[Callable[[], Awaitable[object]]] = [
        lease.start,
        lambda: lease.acquire("gw-a", 1.0),
        lambda: lease.release("gw-a"),
        lease.holder,
    ]
    try:
        for call in calls:
            with pytest.raises(StoreUnavailable):
                await call()
    finally:
        await lease.aclose()

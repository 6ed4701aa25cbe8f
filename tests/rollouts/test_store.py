"""Both rollout stores, one suite: SQLite in a temporary folder and a real ``redis-server`` (the
session's ``redis_url``, one key prefix per test). Then what only one backend has: SQLite's
schema and closing; Redis outages and its key layout."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from redis.asyncio import Redis

from admission.quota import StoreUnavailable
from rollouts.store import (
    FencedOutError,
    RolloutConflictError,
    RolloutStore,
    UnknownRolloutError,
)
from rollouts.store_redis import RedisRolloutStore
from rollouts.store_sqlite import SCHEMA_VERSION, SqliteRolloutStore
from tests.store_backends import Backend, delete_keys, sqlite_or_redis

# More significant digits than Lua's cjson keeps (14): a store that rounds times fails here.
PRECISE_TIME = 1732281234.1234567


def rollout(
    rollout_id: str,
    *,
    alias: str = "llama",
    status: str = "running",
    created_at: float = PRECISE_TIME,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "id": rollout_id,
        "alias": alias,
        "status": status,
        "created_at": created_at,
        "updated_at": created_at,
        "steps": [{"weight": 10, "pause_s": 300.0}, {"weight": 50, "pause_s": 600.0}],
        "step": 0,
        **extra,
    }


@pytest.fixture(params=["sqlite", "redis"])
async def backend(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Backend[RolloutStore]]:
    async with sqlite_or_redis(
        request,
        lambda: SqliteRolloutStore(tmp_path / "state" / "rollouts.db"),
        lambda url, prefix: RedisRolloutStore(url, key_prefix=prefix),
    ) as backend:
        yield backend


@pytest.fixture
async def store(backend: Backend[RolloutStore]) -> RolloutStore:
    store = backend.make()
    await store.start()
    return store


# --- records -----------------------------------------------------------------------------------


async def test_create_then_get_round_trips_the_whole_record_exactly(store: RolloutStore) -> None:
    record = rollout("r1", note="ünïcode", nested={"a": [1, 2.5, None, True]})
    await store.create(record)
    got = await store.get("r1")
    assert got == record
    assert got is not None and got["created_at"] == PRECISE_TIME  # not rounded
    assert await store.get("nope") is None


async def test_list_is_newest_first_with_filters_and_limit(store: RolloutStore) -> None:
    await store.create(rollout("a1", alias="a", status="succeeded", created_at=1.0))
    await store.create(rollout("b1", alias="b", status="aborted", created_at=2.0))
    await store.create(rollout("a2", alias="a", status="failed", created_at=3.0))
    await store.create(rollout("b2", alias="b", status="paused", created_at=4.0))
    await store.create(rollout("a3", alias="a", status="running", created_at=5.0))
    # Same created_at: greater id first, in both stores.
    await store.create(rollout("c1", alias="c", status="succeeded", created_at=5.0))

    async def ids(**query: Any) -> list[str]:
        return [record["id"] for record in await store.list(**query)]

    assert await ids() == ["c1", "a3", "b2", "a2", "b1", "a1"]
    assert await ids(limit=2) == ["c1", "a3"]
    assert await ids(limit=0) == []
    assert await ids(alias="a") == ["a3", "a2", "a1"]
    assert await ids(active=True) == ["a3", "b2"]
    assert await ids(active=False) == ["c1", "a2", "b1", "a1"]
    assert await ids(active=False, limit=2) == ["c1", "a2"]
    assert await ids(alias="a", active=True) == ["a3"]
    assert await ids(alias="a", active=False) == ["a2", "a1"]
    assert await ids(alias="b", active=False, limit=1) == ["b1"]
    assert await ids(alias="nobody") == []
    assert await ids(alias="nobody", active=True) == []
    with pytest.raises(ValueError, match="limit"):
        await store.list(limit=-1)


async def test_list_pages_past_a_hundred_records(store: RolloutStore) -> None:
    # More than a Redis page of finished rollouts newer than the one active: the filter pages on.
    for n in range(105):
        await store.create(rollout(f"f{n:03}", status="succeeded", created_at=1.0 + n))
    await store.create(rollout("active", status="running", created_at=0.5))
    finished = await store.list(active=False, limit=200)
    assert [r["id"] for r in finished] == [f"f{n:03}" for n in reversed(range(105))]
    assert [r["id"] for r in await store.list(alias="llama", active=True)] == ["active"]
    assert [r["id"] for r in await store.list(limit=200)][-1] == "active"


async def test_one_active_rollout_per_alias(
    backend: Backend[RolloutStore], store: RolloutStore
) -> None:
    await store.create(rollout("r1", status="running"))
    replica = backend.make()  # another gateway sees the same active rollout
    with pytest.raises(RolloutConflictError, match="r1") as caught:
        await replica.create(rollout("r2", status="running"))
    assert "abort" in str(caught.value)
    with pytest.raises(RolloutConflictError, match="r1"):
        await store.create(rollout("r2", status="succeeded"))
    await store.create(rollout("other", alias="mistral"))  # another alias is free
    assert await store.get("r2") is None

    await store.save(rollout("r1", status="paused"), fence=1)
    with pytest.raises(RolloutConflictError, match="r1"):
        await store.create(rollout("r2"))
    await store.save(rollout("r1", status="aborted"), fence=1)
    await store.create(rollout("r2"))
    assert [r["id"] for r in await store.list(alias="llama", active=True)] == ["r2"]

    # A finished rollout cannot come back to life beside the new one.
    with pytest.raises(RolloutConflictError, match="r2"):
        await store.save(rollout("r1", status="running"), fence=1)
    assert (await store.get("r1") or {})["status"] == "aborted"


async def test_create_refuses_an_id_already_taken(store: RolloutStore) -> None:
    await store.create(rollout("r1", status="succeeded"))
    with pytest.raises(RolloutConflictError, match="already exists"):
        await store.create(rollout("r1", status="running", note="second"))
    assert await store.get("r1") == rollout("r1", status="succeeded")
    assert await store.list(active=True) == []


async def test_save_replaces_the_record_and_fences_stale_tokens(store: RolloutStore) -> None:
    await store.create(rollout("r1"))
    await store.create(rollout("m1", alias="mistral"))
    step1 = rollout("r1", step=1, updated_at=PRECISE_TIME + 1.5)
    await store.save(step1, fence=3)
    assert await store.get("r1") == step1
    await store.save(step1, fence=3)  # the same holder again

    # A newer holder (token 5) saves; the old one (token 3) is fenced out store-wide, and
    # neither its record nor the highest fence change.
    step2 = rollout("r1", step=2)
    await store.save(step2, fence=5)
    with pytest.raises(FencedOutError, match="another gateway"):
        await store.save(rollout("r1", step=99), fence=3)
    with pytest.raises(FencedOutError):
        await store.save(rollout("m1", alias="mistral", step=99), fence=4)
    assert await store.get("r1") == step2
    assert await store.get("m1") == rollout("m1", alias="mistral")
    await store.save(rollout("m1", alias="mistral", step=1), fence=5)


async def test_a_new_lease_holder_fences_the_old_one_out_before_saving(
    store: RolloutStore,
) -> None:
    await store.create(rollout("r1"))
    await store.save(rollout("r1", step=1), fence=3)
    await store.advance_fence(4)  # the new holder, with nothing to save yet
    with pytest.raises(FencedOutError):
        await store.save(rollout("r1", step=99), fence=3)
    await store.advance_fence(2)  # never lowers it
    with pytest.raises(FencedOutError):
        await store.save(rollout("r1", step=99), fence=3)
    await store.save(rollout("r1", step=2), fence=4)
    assert await store.get("r1") == rollout("r1", step=2)
    with pytest.raises(ValueError, match="fencing token"):
        await store.advance_fence(-1)


async def test_a_refused_save_does_not_raise_the_fence(store: RolloutStore) -> None:
    await store.create(rollout("r1"))
    with pytest.raises(UnknownRolloutError, match="ghost"):
        await store.save(rollout("ghost"), fence=9)
    with pytest.raises(ValueError, match="alias"):
        await store.save(rollout("r1", alias="mistral"), fence=9)
    await store.save(rollout("r1", step=1), fence=2)  # 9 was never recorded
    assert (await store.get("r1") or {})["step"] == 1
    assert await store.list(alias="mistral") == []


async def test_save_keeps_the_listing_place_of_the_first_created_at(store: RolloutStore) -> None:
    await store.create(rollout("old", status="succeeded", created_at=1.0))
    await store.create(rollout("new", created_at=2.0))
    await store.save(rollout("old", status="succeeded", created_at=9.0), fence=1)
    assert [r["id"] for r in await store.list()] == ["new", "old"]
    assert (await store.get("old") or {})["created_at"] == 9.0


async def test_records_and_fences_are_checked(store: RolloutStore) -> None:
    with pytest.raises(ValueError, match="alias"):
        await store.create({"id": "r1", "status": "running", "created_at": 1.0})
    with pytest.raises(ValueError, match="created_at"):
        await store.create(rollout("r1", created_at=float("nan")))
    with pytest.raises(ValueError, match="JSON"):
        await store.create(rollout("r1", score=float("inf")))  # JSON has no infinity
    await store.create(rollout("r1"))
    for fence in (-1, True, 1.5):
        with pytest.raises(ValueError, match="fence"):
            await store.save(rollout("r1"), fence=fence)  # type: ignore[arg-type]
    assert await store.get("r1") == rollout("r1")


# --- commands ----------------------------------------------------------------------------------


async def test_commands_get_seqs_per_rollout_and_read_after_a_seq(store: RolloutStore) -> None:
    await store.create(rollout("r1"))
    await store.create(rollout("m1", alias="mistral"))
    pause = {"action": "pause", "actor": "ops", "reason": "slow", "at": PRECISE_TIME}
    resume = {"action": "resume", "actor": "ops", "reason": "ok", "at": PRECISE_TIME + 1}
    abort = {"action": "abort", "actor": "ops", "reason": "bad", "at": PRECISE_TIME + 2}
    assert await store.push_command("r1", pause) == 1
    assert await store.push_command("m1", abort) == 1
    assert await store.push_command("r1", resume) == 2
    assert await store.push_command("r1", abort) == 3

    assert await store.commands("r1") == [(1, pause), (2, resume), (3, abort)]
    assert await store.commands("r1", after_seq=1) == [(2, resume), (3, abort)]
    assert await store.commands("r1", after_seq=3) == []
    assert await store.commands("r1", after_seq=7) == []
    assert await store.commands("m1") == [(1, abort)]
    assert await store.commands("ghost") == []
    with pytest.raises(ValueError, match="after_seq"):
        await store.commands("r1", after_seq=-1)


async def test_push_to_an_unknown_rollout(store: RolloutStore) -> None:
    with pytest.raises(UnknownRolloutError, match="ghost"):
        await store.push_command("ghost", {"action": "pause"})
    assert await store.commands("ghost") == []


async def test_concurrent_pushes_get_distinct_seqs(
    backend: Backend[RolloutStore], store: RolloutStore
) -> None:
    await store.create(rollout("r1"))
    replica = backend.make()
    seqs = await asyncio.gather(
        *(s.push_command("r1", {"n": n}) for n in range(10) for s in (store, replica))
    )
    assert sorted(seqs) == list(range(1, 21))
    assert [seq for seq, _ in await store.commands("r1")] == list(range(1, 21))


# --- SQLite only -------------------------------------------------------------------------------


async def test_sqlite_start_creates_the_file_and_schema(tmp_path: Path) -> None:
    path = tmp_path / "a" / "rollouts.db"
    store = SqliteRolloutStore(path)
    assert not path.parent.exists()  # construction does no I/O
    await store.start()
    await store.aclose()
    assert await asyncio.to_thread(_user_version, path) == SCHEMA_VERSION


async def test_sqlite_closed_store_is_unavailable(tmp_path: Path) -> None:
    store = SqliteRolloutStore(tmp_path / "rollouts.db")
    await store.start()
    await store.create(rollout("r1"))
    await store.aclose()
    await store.aclose()  # idempotent
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: store.get("r1"),
        lambda: store.create(rollout("r2")),
        lambda: store.save(rollout("r1"), fence=1),
        lambda: store.list(),
        lambda: store.push_command("r1", {}),
        lambda: store.commands("r1"),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailable, match="closed"):
            await call()


async def test_sqlite_unusable_path_is_store_unavailable(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    store = SqliteRolloutStore(a_file / "rollouts.db")
    with pytest.raises(StoreUnavailable):
        await store.start()
    await store.aclose()


# --- Redis only --------------------------------------------------------------------------------


async def test_redis_key_layout(redis_url: str) -> None:
    prefix = f"t{uuid4().hex}:"
    store = RedisRolloutStore(redis_url, key_prefix=prefix)
    raw = Redis.from_url(redis_url, decode_responses=True)
    try:
        await store.create(rollout("r1"))
        await store.create(rollout("m1", alias="mistral", status="succeeded"))
        await store.push_command("r1", {"action": "pause"})
        await store.save(rollout("r1", status="paused"), fence=4)
        keys = {key async for key in raw.scan_iter(match=f"{prefix}*")}
        suffixes = {
            "rollout:r1", "rollout:m1", "rollouts", "alias:llama", "alias:mistral",
            "active", "active:llama", "fence", "commands:r1",
        }  # fmt: skip
        assert keys == {prefix + suffix for suffix in suffixes}
        assert await raw.get(f"{prefix}active:llama") == "r1"
        assert await raw.get(f"{prefix}fence") == "4"

        await store.save(rollout("r1", status="failed"), fence=4)
        assert await raw.exists(f"{prefix}active:llama") == 0
        assert await raw.zrange(f"{prefix}active", 0, -1) == []
    finally:
        await store.aclose()
        await raw.aclose()
        await delete_keys(redis_url, prefix)


async def test_redis_unreachable_is_store_unavailable() -> None:
    store = RedisRolloutStore("redis://127.0.0.1:1/0", timeout_s=0.2)
    calls: list[Callable[[], Awaitable[object]]] = [
        store.start,
        lambda: store.get("r1"),
        lambda: store.create(rollout("r1")),
        lambda: store.save(rollout("r1"), fence=1),
        lambda: store.list(),
        lambda: store.list(alias="llama", active=True),
        lambda: store.push_command("r1", {}),
        lambda: store.commands("r1"),
    ]
    try:
        for call in calls:
            with pytest.raises(StoreUnavailable) as caught:
                await call()
            assert caught.value.__cause__ is not None
    finally:
        await store.aclose()


# --- helpers -----------------------------------------------------------------------------------


def _user_version(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        (user_version,) = conn.execute("PRAGMA user_version").fetchone()
        return int(user_version)
    finally:
        conn.close()

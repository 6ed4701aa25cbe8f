"""Both version stores, one suite: SQLite in a temporary folder and a real ``redis-server`` (the
session's ``redis_url``, one key prefix per test). Then what only one backend has: SQLite's
append-only audit table, schema and closing; Redis outages and its key layout."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from redis.asyncio import Redis

from admission.quota import StoreUnavailable
from core.models import GenerationDefaults
from tests.redis_server import running_redis
from tests.store_backends import Backend, delete_keys, sqlite_or_redis
from versions.records import (
    AuditEntry,
    ModelVersion,
    UnknownVersionError,
    VersionConflictError,
    VersionManifest,
)
from versions.store import VersionStore
from versions.store_redis import RedisVersionStore
from versions.store_sqlite import SCHEMA_VERSION, SqliteVersionStore

# More significant digits than Lua's cjson keeps (14): a store that rounds times fails here.
PRECISE_TIME = 1732281234.1234567


def make_version(
    alias: str = "llama", *, weights: str = "w1", created_at: float = PRECISE_TIME
) -> ModelVersion:
    manifest = VersionManifest(
        weights_sha256=weights,
        tokenizer_sha256="t1",
        chat_template_sha256=None,
        dtype="bfloat16",
        max_model_len=2048,
        engine_args=("--seed=1",),
        defaults=GenerationDefaults(temperature=0.7),
    )
    return ModelVersion.new(
        alias,
        manifest,
        source="/models/src",
        model_dir="/cache/models/x",
        created_at=created_at,
        created_by="key_admin",
        note="a note",
    )


def entry(at: float, *, alias: str | None = "llama", action: str = "policy.set") -> AuditEntry:
    return AuditEntry(
        seq=0,
        at=at,
        actor="key_admin",
        action=action,
        alias=alias,
        subject=alias or "-",
        before=None,
        after={"weights": {"a": 90, "b": 10}, "at": at},
        reason="canary",
    )


@pytest.fixture(params=["sqlite", "redis"])
async def backend(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Backend[VersionStore]]:
    async with sqlite_or_redis(
        request,
        lambda: SqliteVersionStore(tmp_path / "state" / "versions.db"),
        lambda url, prefix: RedisVersionStore(url, key_prefix=prefix),
    ) as backend:
        yield backend


@pytest.fixture
async def store(backend: Backend[VersionStore]) -> VersionStore:
    store = backend.make()
    await store.start()
    return store


# --- versions ----------------------------------------------------------------------------------


async def test_register_is_idempotent_under_one_alias(store: VersionStore) -> None:
    version = make_version()
    assert await store.register(version) == (version, True)
    again = replace(version, note="another note", created_at=PRECISE_TIME + 60)
    assert await store.register(again) == (version, False)  # the stored one, unchanged
    assert await store.list() == [version]


async def test_register_refuses_the_same_content_under_another_alias(store: VersionStore) -> None:
    version = make_version("llama")
    await store.register(version)
    with pytest.raises(VersionConflictError, match=version.name):
        await store.register(replace(version, alias="mistral"))
    assert await store.list("mistral") == []


async def test_get_by_id_name_and_prefix(store: VersionStore) -> None:
    version = make_version()
    await store.register(version)
    version_id = version.version_id
    for ref in (version_id, version.name, version_id[:8], version_id[:12]):
        assert await store.get(ref) == version, ref
    assert await store.get(f"llama@{version_id}") == version
    for ref in (
        version_id[:7],  # too short to be a prefix
        f"mistral@{version_id[:8]}",  # the right id under another alias
        f"@{version_id[:8]}",
        version_id.upper(),
        "f" * 16,
        "",
        "llama",
    ):
        assert await store.get(ref) is None, ref


async def test_an_ambiguous_prefix_names_nothing(store: VersionStore) -> None:
    # Ids chosen by hand (stores key by the id they are given) to share 15 characters.
    first = replace(make_version(weights="a"), version_id="abcdef0100000001")
    second = replace(make_version(weights="b"), version_id="abcdef0100000002")
    other = replace(make_version(weights="c"), version_id="abcdef0200000000")
    for version in (first, second, other):
        await store.register(version)
    for ref in ("abcdef01", "abcdef010000000", "llama@abcdef01"):
        assert await store.get(ref) is None, ref
    assert await store.get("abcdef02") == other
    assert await store.get("abcdef0100000001") == first
    assert await store.get("llama@abcdef0100000002") == second


async def test_list_is_oldest_first_and_filters_by_alias(store: VersionStore) -> None:
    assert await store.list() == []
    late = make_version("llama", weights="late", created_at=300.0)
    early = make_version("llama", weights="early", created_at=100.0)
    other = make_version("mistral", weights="other", created_at=200.0)
    for version in (late, other, early):
        await store.register(version)
    assert await store.list() == [early, other, late]
    assert await store.list("llama") == [early, late]
    assert await store.list("mistral") == [other]
    assert await store.list("missing") == []


async def test_delete_returns_the_version_and_forgets_it(store: VersionStore) -> None:
    kept = make_version(weights="kept", created_at=1.0)
    gone = make_version(weights="gone", created_at=2.0)
    for version in (kept, gone):
        await store.register(version)
    assert await store.delete(gone.version_id) == gone
    assert await store.get(gone.version_id) is None
    assert await store.get(gone.name) is None
    assert await store.list() == [kept]
    assert await store.list("llama") == [kept]
    with pytest.raises(UnknownVersionError, match=gone.version_id):
        await store.delete(gone.version_id)
    # Deleted content may be registered again, under another alias too.
    assert await store.register(replace(gone, alias="mistral")) == (
        replace(gone, alias="mistral"),
        True,
    )


# --- policies ----------------------------------------------------------------------------------


async def test_policies_put_get_list_delete_with_revisions(store: VersionStore) -> None:
    assert await store.policy_revision() == 0
    assert await store.get_policy("llama") is None
    assert await store.list_policies() == {}
    canary: dict[str, Any] = {"arms": [{"version": "a", "weight": 0.9}], "sticky": True}
    assert await store.put_policy("llama", canary) == 1
    assert await store.put_policy("mistral", {"arms": []}) == 2
    assert await store.get_policy("llama") == canary
    replaced = {"arms": [{"version": "b", "weight": 1.0}]}
    assert await store.put_policy("llama", replaced) == 3
    assert await store.policy_revision() == 3
    assert await store.list_policies() == {"llama": replaced, "mistral": {"arms": []}}
    assert await store.delete_policy("llama") is True
    assert await store.policy_revision() == 4
    assert await store.delete_policy("llama") is False
    assert await store.policy_revision() == 4  # nothing changed: replicas need not reload
    assert await store.get_policy("llama") is None
    assert await store.list_policies() == {"mistral": {"arms": []}}


async def test_concurrent_policy_changes_each_get_their_own_revision(store: VersionStore) -> None:
    revisions = await asyncio.gather(*(store.put_policy(f"m{i}", {"i": i}) for i in range(20)))
    assert sorted(revisions) == list(range(1, 21))
    assert await store.policy_revision() == 20


# --- audit -------------------------------------------------------------------------------------


async def test_audit_appends_in_order_with_increasing_seq(store: VersionStore) -> None:
    assert await store.audit() == []
    stored = [await store.append_audit(entry(PRECISE_TIME + i)) for i in range(3)]
    assert [e.seq for e in stored] == sorted({e.seq for e in stored})
    assert stored[0].seq >= 1
    assert stored[0] == replace(entry(PRECISE_TIME), seq=stored[0].seq)  # nothing else changed
    assert await store.audit() == stored


async def test_audit_filters_by_alias_time_and_limit(store: VersionStore) -> None:
    llama = [await store.append_audit(entry(100.0 + i)) for i in range(3)]  # 100, 101, 102
    mistral = await store.append_audit(entry(103.0, alias="mistral"))
    nobody = await store.append_audit(entry(104.0, alias=None, action="version.register"))
    everything = [*llama, mistral, nobody]
    assert await store.audit() == everything
    assert await store.audit(alias="llama") == llama
    assert await store.audit(alias="mistral") == [mistral]
    assert await store.audit(alias="missing") == []
    assert await store.audit(since=101.0) == everything[1:]  # since is inclusive
    assert await store.audit(until=102.0) == llama[:2]  # until is exclusive
    assert await store.audit(since=101.0, until=103.0) == llama[1:]
    assert await store.audit(since=100.0005, until=101.0005) == [llama[1]]  # within a ms
    assert await store.audit(alias="llama", since=102.0) == [llama[2]]
    assert await store.audit(limit=2) == everything[:2]
    assert await store.audit(since=101.0, limit=2) == everything[1:3]
    assert await store.audit(limit=0) == []
    with pytest.raises(ValueError, match="limit"):
        await store.audit(limit=-1)


async def test_audit_times_never_go_back(store: VersionStore) -> None:
    first = await store.append_audit(entry(PRECISE_TIME))
    # Another gateway's clock a little behind: filed at the last entry's time, after it.
    behind = await store.append_audit(entry(PRECISE_TIME - 0.5))
    assert behind.at == first.at and behind.seq > first.seq
    later = await store.append_audit(entry(PRECISE_TIME + 0.0001))  # same millisecond
    assert later.at == PRECISE_TIME + 0.0001
    assert await store.audit() == [first, behind, later]
    assert await store.audit(since=PRECISE_TIME) == [first, behind, later]
    assert await store.audit(until=PRECISE_TIME + 0.0001) == [first, behind]
    with pytest.raises(ValueError, match="not negative"):
        await store.append_audit(entry(-1.0))


async def test_many_entries_in_one_millisecond_page_through(store: VersionStore) -> None:
    stored = [await store.append_audit(entry(50.0 + i * 1e-6)) for i in range(7)]
    assert await store.audit(since=50.0, until=50.001) == stored
    assert await store.audit(since=50.0 + 3e-6, limit=3) == stored[3:6]
    assert await store.audit(since=0.0) == stored


# --- replicas ----------------------------------------------------------------------------------


async def test_a_second_store_sees_the_first_ones_writes(backend: Backend[VersionStore]) -> None:
    first, second = backend.make(), backend.make()
    version = make_version()
    await first.register(version)
    assert await second.get(version.name) == version
    assert await second.register(version) == (version, False)
    revision = await first.put_policy("llama", {"arms": []})
    assert await second.policy_revision() == revision
    assert await second.get_policy("llama") == {"arms": []}
    appended = await first.append_audit(entry(10.0))
    assert await second.audit() == [appended]
    later = await second.append_audit(entry(11.0))
    assert later.seq > appended.seq
    assert await first.audit() == [appended, later]
    await second.delete(version.version_id)
    assert await first.get(version.version_id) is None


# --- SQLite only -------------------------------------------------------------------------------


async def test_sqlite_audit_table_refuses_update_and_delete(tmp_path: Path) -> None:
    path = tmp_path / "versions.db"
    store = SqliteVersionStore(path)
    await store.append_audit(entry(1.0))
    await store.aclose()

    def tamper(statement: str) -> None:
        conn = sqlite3.connect(path)
        try:
            conn.execute(statement)
            conn.commit()
        finally:
            conn.close()

    for statement in ("UPDATE audit SET reason = 'edited'", "DELETE FROM audit"):
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            await asyncio.to_thread(tamper, statement)
    reopened = SqliteVersionStore(path)
    try:
        [kept] = await reopened.audit()
        assert kept.reason == "canary"
    finally:
        await reopened.aclose()


async def test_sqlite_start_creates_folders_wal_and_the_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "versions.db"
    store = SqliteVersionStore(path)
    assert not path.parent.exists()  # construction does no I/O
    await store.start()
    await store.aclose()
    journal_mode, user_version = await asyncio.to_thread(_inspect, path)
    assert (journal_mode, user_version) == ("wal", SCHEMA_VERSION)


async def test_sqlite_refuses_a_newer_file_and_calls_after_close(tmp_path: Path) -> None:
    newer = tmp_path / "newer.db"
    await asyncio.to_thread(_set_user_version, newer, SCHEMA_VERSION + 1)
    store = SqliteVersionStore(newer)
    with pytest.raises(StoreUnavailable, match="newer"):
        await store.start()
    await store.aclose()

    store = SqliteVersionStore(tmp_path / "versions.db")
    await store.start()
    await store.aclose()
    await store.aclose()  # idempotent
    with pytest.raises(StoreUnavailable, match="closed"):
        await store.policy_revision()


async def test_sqlite_unusable_path_is_store_unavailable(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    store = SqliteVersionStore(a_file / "versions.db")
    with pytest.raises(StoreUnavailable) as caught:
        await store.start()
    assert isinstance(caught.value.__cause__, sqlite3.Error | OSError)
    await store.aclose()


# --- Redis only --------------------------------------------------------------------------------


async def test_redis_deleting_every_version_leaves_only_policies_and_audit(redis_url: str) -> None:
    prefix = f"test:{uuid4().hex}:"
    store = RedisVersionStore(redis_url, key_prefix=prefix)
    raw = Redis.from_url(redis_url, decode_responses=True)
    try:
        for weights in ("a", "b"):
            await store.register(make_version(weights=weights))
        await store.append_audit(entry(1.0))
        for version in await store.list():
            await store.delete(version.version_id)
        keys = {key async for key in raw.scan_iter(match=f"{prefix}*")}
        suffixes = {"audit", "audit:seq", "audit:alias:llama"}
        assert keys == {prefix + suffix for suffix in suffixes}
    finally:
        await store.aclose()
        await raw.aclose()
        await delete_keys(redis_url, prefix)


async def test_redis_outage_and_silence_become_store_unavailable() -> None:
    with running_redis() as server:
        store = RedisVersionStore(server.url, key_prefix="t:", timeout_s=0.2)
        try:
            await store.start()
            await store.put_policy("llama", {})

            server.pause()  # accepts connections, never answers
            try:
                with pytest.raises(StoreUnavailable) as caught:
                    await store.policy_revision()
                assert caught.value.__cause__ is not None
            finally:
                server.resume()
            assert await store.policy_revision() == 1

            server.stop()  # refuses connections
            calls: list[Callable[[], Awaitable[object]]] = [
                store.start,
                lambda: store.register(make_version()),
                store.audit,
            ]
            for call in calls:
                with pytest.raises(StoreUnavailable):
                    await call()
        finally:
            await store.aclose()


# --- helpers -----------------------------------------------------------------------------------


def _inspect(path: Path) -> tuple[str, int]:
    conn = sqlite3.connect(path)
    try:
        (journal_mode,) = conn.execute("PRAGMA journal_mode").fetchone()
        (user_version,) = conn.execute("PRAGMA user_version").fetchone()
        return journal_mode, user_version
    finally:
        conn.close()


def _set_user_version(path: Path, version: int) -> None:
    conn = sqlite3.connect(path)
    try:
        conn.execute(f"PRAGMA user_version = {version}")
    finally:
        conn.close()

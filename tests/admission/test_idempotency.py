"""Idempotency keys: header parsing, fingerprints, and one suite for both stores (the semantics
of ``admission.idempotency`` hold in memory and in a real Redis alike).

The memory store runs on a fake clock, so its times are exact. Redis keeps its own clock (TTLs),
so its tests sleep through short real leases, with margins of a few hundred milliseconds.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from uuid import uuid4

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

import admission.idempotency
from admission.idempotency import (
    Claimed,
    IdempotencyStore,
    InProgress,
    MemoryIdempotencyStore,
    Mismatch,
    Replay,
    StoredResponse,
    fingerprint,
    parse_idempotency_key,
    scope_key,
)
from admission.idempotency_redis import RedisIdempotencyStore
from core.errors import InvalidRequestError, StoreUnavailableError
from tests.redis_server import running_redis

ROUTE = "/v1/chat/completions"
SCOPE = scope_key("acme", ROUTE, "key-1")
FP = fingerprint({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
OTHER_FP = fingerprint({"model": "m", "messages": [{"role": "user", "content": "bye"}]})
LEASE_S = 30.0
RETENTION_S = 86_400.0
RESPONSE = StoredResponse(status_code=200, body=b'{"id":"chatcmpl-1"}', created_at=1.7e9 + 0.125)


# --- parse_idempotency_key -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "key"),
    [
        (None, None),
        ("abc-123", "abc-123"),
        ("  abc \t", "abc"),
        ('"abc"', "abc"),
        ('"with space"', "with space"),
        ('"a\\"b\\\\c"', 'a"b\\c'),
        ('a"b', 'a"b'),  # only a leading quote makes it an sf-string
        ("k" * 255, "k" * 255),
        ('"' + "k" * 255 + '"', "k" * 255),
    ],
)
def test_parse_accepts(header: str | None, key: str | None) -> None:
    assert parse_idempotency_key(header) == key


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ('""', "empty"),
        ("k" * 256, "256 characters"),
        ('"' + "k" * 256 + '"', "256 characters"),
        ("a\x00b", "not printable"),
        ("a\nb", "not printable"),
        ("a\x7fb", "not printable"),
        ("clé", "not printable"),
        ('"abc', "no closing quote"),
        ('"a"b', "after its closing quote"),
        ('"a\\nb"', "backslash"),
        ('"abc\\"', "no closing quote"),
        ('"a\tb"', "not printable"),
    ],
)
def test_parse_rejects(header: str, problem: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_idempotency_key(header)
    assert problem in caught.value.message
    assert "1 to 255 printable ASCII characters" in caught.value.message
    assert caught.value.param == "Idempotency-Key"
    assert caught.value.status_code == 400


# --- fingerprint and scope_key ---------------------------------------------------------------


def test_fingerprint_ignores_key_order_and_whitespace() -> None:
    import orjson

    compact = orjson.loads(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"n":1}')
    spaced = orjson.loads(
        b'{ "n" : 1,\n  "messages": [ {"content": "hi", "role": "user"} ],\n  "model": "m" }'
    )

    assert fingerprint(compact) == fingerprint(spaced)
    assert len(fingerprint(compact)) == 64
    assert int(fingerprint(compact), 16) >= 0


def test_fingerprint_ignores_stream_fields_at_top_level_only() -> None:
    body = {"model": "m", "messages": []}
    streaming = {**body, "stream": True, "stream_options": {"include_usage": True}}

    assert fingerprint(streaming) == fingerprint(body)
    assert fingerprint({**body, "stream": False}) == fingerprint(body)
    assert fingerprint({**body, "metadata": {"stream": True}}) != fingerprint(
        {**body, "metadata": {"stream": False}}
    )


@pytest.mark.parametrize(
    "changed",
    [
        {"model": "m2", "messages": [{"role": "user", "content": "hi"}]},
        {"model": "m", "messages": [{"role": "user", "content": "hi "}]},
        {"model": "m", "messages": [{"role": "system", "content": "hi"}]},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": 1},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": None},
        {"model": "m", "messages": []},
    ],
)
def test_fingerprint_changes_with_any_value(changed: dict[str, object]) -> None:
    assert fingerprint(changed) != FP


def test_fingerprint_of_integers_past_64_bits() -> None:
    big = {"model": "m", "seed": 2**70}

    assert fingerprint(big) == fingerprint({"seed": 2**70, "model": "m"})
    assert fingerprint(big) != fingerprint({"model": "m", "seed": 2**70 + 1})


def test_scope_key_is_unambiguous() -> None:
    assert scope_key("a:b", "c", "d") != scope_key("a", "b:c", "d")
    assert scope_key("a", "b:c", "d") != scope_key("a", "b", "c:d")
    assert scope_key("1:a", "b", "c") != scope_key("1", "a:b", "c")
    assert scope_key("acme", ROUTE, "k") == scope_key("acme", ROUTE, "k")


def test_public_exports() -> None:
    assert set(admission.idempotency.__all__) == {
        "MAX_KEY_LENGTH",
        "RETRY_AFTER_MAX_S",
        "RETRY_AFTER_MIN_S",
        "ClaimResult",
        "Claimed",
        "IdempotencyStore",
        "InProgress",
        "MemoryIdempotencyStore",
        "Mismatch",
        "Replay",
        "StoredResponse",
        "check_seconds",
        "fingerprint",
        "new_token",
        "parse_idempotency_key",
        "retry_after_s",
        "scope_key",
    }
    for name in admission.idempotency.__all__:
        assert hasattr(admission.idempotency, name)


# --- Both stores -----------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    store: IdempotencyStore
    clock: FakeClock | None
    """``None``: the store keeps real time (Redis TTLs)."""

    async def advance(self, seconds: float) -> None:
        if self.clock is None:
            await asyncio.sleep(seconds)
        else:
            self.clock.now += seconds

    async def claim(self, scope: str = SCOPE, fp: str = FP, lease_s: float = LEASE_S) -> Claimed:
        result = await self.store.claim(scope, fp, lease_s)
        assert isinstance(result, Claimed), result
        return result

    async def replay(self, scope: str = SCOPE, fp: str = FP) -> StoredResponse:
        result = await self.store.claim(scope, fp, LEASE_S)
        assert isinstance(result, Replay), result
        return result.response


@pytest.fixture(params=["memory", "redis"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    if request.param == "memory":
        clock = FakeClock()
        store: IdempotencyStore = MemoryIdempotencyStore(clock)
        yield Harness(store, clock)
    else:
        url = request.getfixturevalue("redis_url")
        # A prefix of its own per test: no flush, no leftovers from another test.
        store = RedisIdempotencyStore(url, prefix=f"test:{uuid4().hex}:")
        yield Harness(store, None)
    await store.aclose()


async def test_claim_then_in_progress_for_the_same_fingerprint(harness: Harness) -> None:
    claimed = await harness.claim()

    again = await harness.store.claim(SCOPE, FP, LEASE_S)

    assert len(claimed.token) == 32
    assert isinstance(again, InProgress)
    assert again.retry_after_s == 10.0  # 30 s left, clamped


async def test_in_progress_retry_after_is_the_lease_left_clamped(harness: Harness) -> None:
    await harness.claim(lease_s=4.0)

    first = await harness.store.claim(SCOPE, FP, LEASE_S)
    assert isinstance(first, InProgress)
    if harness.clock is None:
        assert 3.0 < first.retry_after_s <= 4.0
        return
    assert first.retry_after_s == 4.0
    await harness.advance(3.5)
    late = await harness.store.claim(SCOPE, FP, LEASE_S)
    assert late == InProgress(retry_after_s=1.0)  # 0.5 s left, clamped up


async def test_mismatch_while_running_and_after_completion(harness: Harness) -> None:
    claimed = await harness.claim()

    assert await harness.store.claim(SCOPE, OTHER_FP, LEASE_S) == Mismatch()
    assert await harness.store.complete(SCOPE, claimed.token, RESPONSE, RETENTION_S)
    assert await harness.store.claim(SCOPE, OTHER_FP, LEASE_S) == Mismatch()


async def test_complete_then_replay_the_exact_response(harness: Harness) -> None:
    claimed = await harness.claim()
    # Not UTF-8, NUL, an error status and a created_at with every bit of a float in use.
    response = StoredResponse(
        status_code=502,
        body=b"\x00\xff\xfe{}\n" + bytes(range(256)),
        created_at=1_712_345_678.123456789,
    )

    assert await harness.store.complete(SCOPE, claimed.token, response, RETENTION_S)

    assert await harness.replay() == response
    assert await harness.replay() == response  # a replay leaves the record as it was


async def test_complete_twice_is_refused(harness: Harness) -> None:
    claimed = await harness.claim()
    assert await harness.store.complete(SCOPE, claimed.token, RESPONSE, RETENTION_S)

    other = StoredResponse(status_code=500, body=b"{}", created_at=0.0)
    assert not await harness.store.complete(SCOPE, claimed.token, other, RETENTION_S)

    assert await harness.replay() == RESPONSE


async def test_release_frees_the_key(harness: Harness) -> None:
    claimed = await harness.claim()

    await harness.store.release(SCOPE, claimed.token)

    again = await harness.claim(fp=OTHER_FP)  # free: any fingerprint may take it
    assert again.token != claimed.token


async def test_release_with_another_token_or_after_completion_does_nothing(
    harness: Harness,
) -> None:
    claimed = await harness.claim()

    await harness.store.release(SCOPE, "not-the-token")
    assert isinstance(await harness.store.claim(SCOPE, FP, LEASE_S), InProgress)

    assert await harness.store.complete(SCOPE, claimed.token, RESPONSE, RETENTION_S)
    await harness.store.release(SCOPE, claimed.token)
    assert await harness.replay() == RESPONSE


async def test_complete_with_a_wrong_token_changes_nothing(harness: Harness) -> None:
    claimed = await harness.claim()

    assert not await harness.store.complete(SCOPE, "not-the-token", RESPONSE, RETENTION_S)

    assert isinstance(await harness.store.claim(SCOPE, FP, LEASE_S), InProgress)
    assert await harness.store.complete(SCOPE, claimed.token, RESPONSE, RETENTION_S)


async def test_lease_expiry_frees_a_dead_claim_and_its_owner_loses_it(harness: Harness) -> None:
    stale = await harness.claim(lease_s=0.2)
    await harness.advance(0.4)

    fresh = await harness.claim(lease_s=LEASE_S)

    late = StoredResponse(status_code=200, body=b"late", created_at=1.0)
    assert not await harness.store.complete(SCOPE, stale.token, late, RETENTION_S)
    assert not await harness.store.extend(SCOPE, stale.token, LEASE_S)
    await harness.store.release(SCOPE, stale.token)
    assert isinstance(await harness.store.claim(SCOPE, FP, LEASE_S), InProgress)

    assert await harness.store.complete(SCOPE, fresh.token, RESPONSE, RETENTION_S)
    assert await harness.replay() == RESPONSE


async def test_an_expired_lease_is_lost_even_if_nobody_took_the_key(harness: Harness) -> None:
    stale = await harness.claim(lease_s=0.2)
    await harness.advance(0.4)

    assert not await harness.store.extend(SCOPE, stale.token, LEASE_S)
    assert not await harness.store.complete(SCOPE, stale.token, RESPONSE, RETENTION_S)
    await harness.claim(fp=OTHER_FP)


async def test_retention_expiry_frees_a_completed_key(harness: Harness) -> None:
    claimed = await harness.claim()
    assert await harness.store.complete(SCOPE, claimed.token, RESPONSE, retention_s=0.2)
    assert await harness.replay() == RESPONSE

    await harness.advance(0.4)

    await harness.claim(fp=OTHER_FP)


async def test_extend_renews_the_lease(harness: Harness) -> None:
    claimed = await harness.claim(lease_s=0.5)
    await harness.advance(0.3)

    assert await harness.store.extend(SCOPE, claimed.token, 1.0)
    assert not await harness.store.extend(SCOPE, "not-the-token", 1.0)
    await harness.advance(0.4)  # past the first lease, within the renewed one

    assert isinstance(await harness.store.claim(SCOPE, FP, LEASE_S), InProgress)
    assert await harness.store.complete(SCOPE, claimed.token, RESPONSE, RETENTION_S)
    assert not await harness.store.extend(SCOPE, claimed.token, 1.0)  # completed: not a lease
    assert await harness.replay() == RESPONSE


async def test_concurrent_claims_of_one_key_have_one_winner(harness: Harness) -> None:
    results = await asyncio.gather(*(harness.store.claim(SCOPE, FP, LEASE_S) for _ in range(50)))

    assert sum(isinstance(r, Claimed) for r in results) == 1
    assert sum(isinstance(r, InProgress) for r in results) == 49


async def test_scopes_are_independent(harness: Harness) -> None:
    scopes = [
        scope_key("acme", ROUTE, "k"),
        scope_key("globex", ROUTE, "k"),
        scope_key("acme", "/v1/completions", "k"),
        scope_key("acme", ROUTE, "k2"),
    ]
    tokens = [(await harness.claim(scope=scope)).token for scope in scopes]

    assert await harness.store.complete(scopes[0], tokens[0], RESPONSE, RETENTION_S)
    # Another scope's token is no key to this one.
    assert not await harness.store.complete(scopes[1], tokens[0], RESPONSE, RETENTION_S)

    assert await harness.replay(scopes[0]) == RESPONSE
    for scope in scopes[1:]:
        assert isinstance(await harness.store.claim(scope, FP, LEASE_S), InProgress)


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan")])
async def test_non_positive_durations_are_refused(harness: Harness, seconds: float) -> None:
    with pytest.raises(ValueError, match="lease_s"):
        await harness.store.claim(SCOPE, FP, seconds)
    claimed = await harness.claim()
    with pytest.raises(ValueError, match="lease_s"):
        await harness.store.extend(SCOPE, claimed.token, seconds)
    with pytest.raises(ValueError, match="retention_s"):
        await harness.store.complete(SCOPE, claimed.token, RESPONSE, seconds)


# --- The memory store's bounds ---------------------------------------------------------------


async def test_memory_sweeps_expired_records() -> None:
    clock = FakeClock()
    store = MemoryIdempotencyStore(clock)
    for i in range(1000):
        claimed = await store.claim(f"k{i}", FP, 1.0)
        assert isinstance(claimed, Claimed)
        if i % 2:
            assert await store.complete(f"k{i}", claimed.token, RESPONSE, 2.0)
        assert await store.extend(f"k{i}", claimed.token, 1.0) == (i % 2 == 0)
    assert store.num_records == 1000

    clock.now += 1.5
    await store.claim("new", FP, 1.0)
    assert store.num_records == 501  # the running claims expired, the completed ones remain

    clock.now += 0.9
    newer = await store.claim("newer", FP, 1.0)
    assert store.num_records == 2  # "new" and "newer"
    assert isinstance(newer, Claimed)

    # A long stream renewing its lease leaves outdated expiries, not yet due, behind it.
    for i in range(5000):
        assert await store.extend("newer", newer.token, 100.0 + i)
    await store.claim("newest", FP, 1.0)
    assert len(store._expiries) <= 2 * store.num_records + 1024
    assert isinstance(await store.claim("newer", FP, 1.0), InProgress)


async def test_memory_cap_evicts_the_oldest_completed_records_first() -> None:
    store = MemoryIdempotencyStore(FakeClock(), max_entries=3)
    tokens = {}
    for name in ("a", "b", "c"):
        claimed = await store.claim(name, FP, LEASE_S)
        assert isinstance(claimed, Claimed)
        tokens[name] = claimed.token
    # Completed in the order c, a: b stays running.
    assert await store.complete("c", tokens["c"], RESPONSE, RETENTION_S)
    assert await store.complete("a", tokens["a"], RESPONSE, RETENTION_S)

    assert isinstance(await store.claim("d", FP, LEASE_S), Claimed)  # evicts c
    assert store.num_records == 3
    assert isinstance(await store.claim("a", FP, LEASE_S), Replay)
    assert isinstance(await store.claim("b", FP, LEASE_S), InProgress)

    assert isinstance(await store.claim("e", FP, LEASE_S), Claimed)  # evicts a
    assert isinstance(await store.claim("f", FP, LEASE_S), Claimed)  # all running: evicts b
    assert not await store.complete("b", tokens["b"], RESPONSE, RETENTION_S)
    assert store.num_records == 3
    assert isinstance(await store.claim("a", FP, LEASE_S), Claimed)  # evicts d, the oldest


def test_memory_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        MemoryIdempotencyStore(max_entries=0)


# --- Redis only ------------------------------------------------------------------------------


async def test_redis_enforces_lease_and_retention_with_ttls(redis_url: str) -> None:
    prefix = f"test:{uuid4().hex}:"
    store = RedisIdempotencyStore(redis_url, prefix=prefix)
    raw = Redis.from_url(redis_url, decode_responses=True)
    try:
        claimed = await store.claim(SCOPE, FP, LEASE_S)
        assert isinstance(claimed, Claimed)
        assert await raw.keys(f"{prefix}*") == [f"{prefix}{SCOPE}"]
        assert 29_000 < await raw.pttl(f"{prefix}{SCOPE}") <= 30_000

        assert await store.extend(SCOPE, claimed.token, 60.0)
        assert 59_000 < await raw.pttl(f"{prefix}{SCOPE}") <= 60_000

        assert await store.complete(SCOPE, claimed.token, RESPONSE, RETENTION_S)
        assert 86_399_000 < await raw.pttl(f"{prefix}{SCOPE}") <= 86_400_000
        assert set(await raw.hkeys(f"{prefix}{SCOPE}")) == {"fp", "code", "body", "at"}
    finally:
        await raw.aclose()
        await store.aclose()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens once the socket closes


async def test_redis_on_a_closed_port_fails_fast() -> None:
    store = RedisIdempotencyStore(
        f"redis://user:secret@127.0.0.1:{_closed_port()}/0", timeout_s=0.5
    )
    try:
        for call in (
            lambda: store.claim(SCOPE, FP, LEASE_S),
            lambda: store.complete(SCOPE, "t", RESPONSE, RETENTION_S),
            lambda: store.release(SCOPE, "t"),
            lambda: store.extend(SCOPE, "t", LEASE_S),
        ):
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError) as caught:
                await call()
            assert time.monotonic() - started < 1.5
            assert isinstance(caught.value.__cause__, RedisError | OSError)
            assert "idempotency store" in caught.value.message
            assert "127.0.0.1" in caught.value.message
            assert "secret" not in caught.value.message
            assert caught.value.status_code == 503
    finally:
        await store.aclose()


async def test_redis_outage_fails_fast_and_recovers() -> None:
    with running_redis() as server:
        store = RedisIdempotencyStore(server.url, timeout_s=0.5)
        try:
            await store.claim(SCOPE, FP, LEASE_S)  # a pooled connection to break
            server.stop()

            started = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                await store.claim(SCOPE, FP, LEASE_S)
            assert time.monotonic() - started < 1.5

            server.start()  # same port, empty data, empty script cache

            assert isinstance(await store.claim(SCOPE, FP, LEASE_S), Claimed)
        finally:
            await store.aclose()

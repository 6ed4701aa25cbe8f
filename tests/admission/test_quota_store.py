"""One suite for both quota stores: the semantics of ``admission.quota`` hold in memory and in a
real Redis alike.

The memory store runs on a frozen fake clock, so its numbers are exact. Redis keeps its own
clock (``TIME``), so time passes between two calls there: levels may only have grown and waits
only shrunk by what ``SLACK_S`` of real time refills, and the bounds are one-sided accordingly.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from uuid import uuid4

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from admission.plans import QuotaLimits
from admission.quota import (
    Denial,
    LimitKind,
    QuotaSnapshot,
    QuotaStore,
    Reservation,
    StoreUnavailable,
)
from admission.quota_memory import MemoryQuotaStore
from admission.quota_redis import RedisQuotaStore
from tests.redis_server import running_redis

TENANT = "acme"
HOLD_S = 30.0
SLACK_S = 1.0
"""Real time a Redis test may spend between two calls before its bounds fail."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    store: QuotaStore
    clock: FakeClock | None
    """``None``: the store keeps real time (Redis ``TIME``)."""

    @property
    def real_time(self) -> bool:
        return self.clock is None

    async def advance(self, seconds: float) -> None:
        if self.clock is None:
            await asyncio.sleep(seconds)
        else:
            self.clock.now += seconds

    async def reserve(
        self, limits: QuotaLimits, tokens: int, hold_s: float = HOLD_S
    ) -> Reservation:
        result = await self.store.reserve(TENANT, limits, tokens, hold_s)
        assert isinstance(result, Reservation), result
        return result

    async def deny(self, limits: QuotaLimits, tokens: int, hold_s: float = HOLD_S) -> Denial:
        result = await self.store.reserve(TENANT, limits, tokens, hold_s)
        assert isinstance(result, Denial), result
        return result

    def assert_level(self, actual: int | None, expected: int, per_minute: int) -> None:
        """``actual`` remaining, given ``expected`` at the last write and a refill of
        ``per_minute``."""
        assert actual is not None
        if self.real_time:
            assert expected <= actual <= expected + per_minute / 60 * SLACK_S + 1
        else:
            assert actual == expected

    def assert_wait(self, actual: float | None, expected: float) -> None:
        assert actual is not None
        if self.real_time:
            assert expected - SLACK_S <= actual <= expected + 1e-6
        else:
            assert actual == pytest.approx(expected, abs=1e-9)


@pytest.fixture(params=["memory", "redis"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    if request.param == "memory":
        clock = FakeClock()
        store: QuotaStore = MemoryQuotaStore(clock)
        yield Harness(store, clock)
    else:
        url = request.getfixturevalue("redis_url")
        # A prefix of its own per test: no flush, no leftovers from another test. The timeout is
        # the tests' on outages (below) to bound; here a burst of 200 first calls opens 200
        # connections at once, which the default 1 s deadline did not always cover on a busy
        # 2-core machine.
        store = RedisQuotaStore(url, key_prefix=f"test:{uuid4().hex}:", timeout_s=5.0)
        yield Harness(store, None)
    await store.aclose()


async def test_reserve_within_limits(harness: Harness) -> None:
    limits = QuotaLimits(tpm=1000, rpm=10, max_concurrent=5)

    first = await harness.reserve(limits, 100)
    second = await harness.reserve(limits, 100)

    assert (first.tenant_id, first.tokens, len(first.reservation_id)) == (TENANT, 100, 32)
    assert first.reservation_id != second.reservation_id
    # Taken from full buckets in one step, so these are exact even on Redis's clock.
    snapshot = first.snapshot
    assert (snapshot.limit_tokens, snapshot.remaining_tokens) == (1000, 900)
    assert (snapshot.limit_requests, snapshot.remaining_requests) == (10, 9)
    assert snapshot.reset_tokens_s == pytest.approx(6.0)
    assert snapshot.reset_requests_s == pytest.approx(6.0)
    assert snapshot.concurrent == 1
    assert second.snapshot.concurrent == 2


async def test_denied_by_tokens_with_retry_after(harness: Harness) -> None:
    limits = QuotaLimits(tpm=600, rpm=60, max_concurrent=None)  # 10 tokens/s
    await harness.reserve(limits, 500)

    denial = await harness.deny(limits, 300)

    assert denial.limit is LimitKind.TOKENS
    harness.assert_wait(denial.retry_after_s, 20.0)  # 200 missing at 10/s
    harness.assert_level(denial.snapshot.remaining_tokens, 100, 600)
    harness.assert_level(denial.snapshot.remaining_requests, 59, 60)
    assert denial.snapshot.concurrent == 1


async def test_denied_by_requests(harness: Harness) -> None:
    limits = QuotaLimits(tpm=1000, rpm=2, max_concurrent=None)  # one request per 30 s
    await harness.reserve(limits, 10)
    await harness.reserve(limits, 10)

    denial = await harness.deny(limits, 10)

    assert denial.limit is LimitKind.REQUESTS
    harness.assert_wait(denial.retry_after_s, 30.0)
    assert denial.snapshot.remaining_requests == 0
    harness.assert_level(denial.snapshot.remaining_tokens, 980, 1000)


async def test_denied_by_concurrency(harness: Harness) -> None:
    limits = QuotaLimits(tpm=None, rpm=None, max_concurrent=2)
    await harness.reserve(limits, 10)
    await harness.reserve(limits, 10)

    denial = await harness.deny(limits, 10)

    assert denial.limit is LimitKind.CONCURRENCY
    harness.assert_wait(denial.retry_after_s, HOLD_S)  # until the first hold expires
    assert denial.snapshot.concurrent == 2


async def test_denial_reports_the_longest_wait(harness: Harness) -> None:
    # 10 tokens/s, one request per 20 s, holds of 45 s: after three reservations all three fail.
    limits = QuotaLimits(tpm=600, rpm=3, max_concurrent=3)
    for _ in range(3):
        await harness.reserve(limits, 200, hold_s=45.0)

    by_tokens = await harness.deny(limits, 600)  # tokens 60 s, requests 20 s, holds 45 s
    by_holds = await harness.deny(limits, 100)  # tokens 10 s, requests 20 s, holds 45 s
    no_hold_limit = QuotaLimits(tpm=600, rpm=3, max_concurrent=None)
    by_requests = await harness.deny(no_hold_limit, 100)  # tokens 10 s, requests 20 s

    assert by_tokens.limit is LimitKind.TOKENS
    harness.assert_wait(by_tokens.retry_after_s, 60.0)
    assert by_holds.limit is LimitKind.CONCURRENCY
    harness.assert_wait(by_holds.retry_after_s, 45.0)
    assert by_requests.limit is LimitKind.REQUESTS
    harness.assert_wait(by_requests.retry_after_s, 20.0)


async def test_denial_takes_nothing_from_any_limit(harness: Harness) -> None:
    limits = QuotaLimits(tpm=1000, rpm=10, max_concurrent=1)
    first = await harness.reserve(limits, 100)

    # Tokens and requests would pass; the concurrency limit fails.
    by_holds = await harness.deny(limits, 10)
    # Requests and holds would pass; the tokens fail.
    by_tokens = await harness.deny(QuotaLimits(tpm=1000, rpm=10, max_concurrent=None), 950)

    assert (by_holds.limit, by_tokens.limit) == (LimitKind.CONCURRENCY, LimitKind.TOKENS)
    after = await harness.store.snapshot(TENANT, limits)
    harness.assert_level(after.remaining_tokens, 900, 1000)
    harness.assert_level(after.remaining_requests, 9, 10)
    assert after.concurrent == 1
    await harness.store.reconcile(first, limits, 100)
    again = await harness.reserve(limits, 10)
    harness.assert_level(again.snapshot.remaining_tokens, 890, 1000)
    harness.assert_level(again.snapshot.remaining_requests, 8, 10)


async def test_request_larger_than_the_plan_is_never_admitted(harness: Harness) -> None:
    limits = QuotaLimits(tpm=1000, rpm=1, max_concurrent=None)
    too_large = await harness.deny(limits, 1001)
    await harness.reserve(limits, 1)  # the request bucket is now empty: 60 s to wait
    still_too_large = await harness.deny(limits, 1001)

    for denial in (too_large, still_too_large):
        assert (denial.limit, denial.retry_after_s) == (LimitKind.TOKENS, None)


@pytest.mark.parametrize(
    ("limits", "kind"),
    [
        (QuotaLimits(tpm=None, rpm=0, max_concurrent=None), LimitKind.REQUESTS),
        (QuotaLimits(tpm=None, rpm=None, max_concurrent=0), LimitKind.CONCURRENCY),
    ],
)
async def test_zero_limit_is_never_admitted(
    harness: Harness, limits: QuotaLimits, kind: LimitKind
) -> None:
    denial = await harness.deny(limits, 1)
    assert (denial.limit, denial.retry_after_s) == (kind, None)


async def test_tokens_refill_over_time(harness: Harness) -> None:
    limits = QuotaLimits(tpm=6000, rpm=None, max_concurrent=None)  # 100 tokens/s
    emptied = await harness.reserve(limits, 6000)
    assert emptied.snapshot.remaining_tokens == 0
    denial = await harness.deny(limits, 50)
    harness.assert_wait(denial.retry_after_s, 0.5)

    await harness.advance(0.6)

    refilled = await harness.store.snapshot(TENANT, limits)
    harness.assert_level(refilled.remaining_tokens, 60, 6000)
    harness.assert_wait(refilled.reset_tokens_s, 59.4)
    await harness.reserve(limits, 50)


async def test_reconcile_refunds_unused_tokens(harness: Harness) -> None:
    limits = QuotaLimits(tpm=1000, rpm=10, max_concurrent=None)
    reservation = await harness.reserve(limits, 300)

    await harness.store.reconcile(reservation, limits, 100)

    after = await harness.store.snapshot(TENANT, limits)
    harness.assert_level(after.remaining_tokens, 900, 1000)
    harness.assert_level(after.remaining_requests, 9, 10)  # the request itself is not refunded


async def test_a_request_that_never_ran_gets_its_request_unit_back(harness: Harness) -> None:
    limits = QuotaLimits(tpm=1000, rpm=10, max_concurrent=None)
    reservation = await harness.reserve(limits, 300)

    await harness.store.reconcile(reservation, limits, 0, ran=False)  # shed or left the queue

    after = await harness.store.snapshot(TENANT, limits)
    harness.assert_level(after.remaining_tokens, 1000, 1000)
    harness.assert_level(after.remaining_requests, 10, 10)


async def test_refund_is_capped_at_capacity(harness: Harness) -> None:
    limits = QuotaLimits(tpm=6000, rpm=None, max_concurrent=None)  # 100 tokens/s
    reservation = await harness.reserve(limits, 50)
    await harness.advance(0.3)  # refills 30 of the 50

    await harness.store.reconcile(reservation, limits, 0)

    after = await harness.store.snapshot(TENANT, limits)
    assert (after.remaining_tokens, after.reset_tokens_s) == (6000, 0.0)


async def test_overuse_goes_below_zero_and_is_paid_back(harness: Harness) -> None:
    limits = QuotaLimits(tpm=1000, rpm=10, max_concurrent=None)
    reservation = await harness.reserve(limits, 100)

    await harness.store.reconcile(reservation, limits, 1500)  # 1400 more than reserved

    after = await harness.store.snapshot(TENANT, limits)
    assert after.remaining_tokens == 0  # the level is -500; headers never show debt
    harness.assert_wait(after.reset_tokens_s, 90.0)  # 1500 missing at 1000/60 per s
    denial = await harness.deny(limits, 10)
    assert denial.limit is LimitKind.TOKENS
    harness.assert_wait(denial.retry_after_s, 30.6)  # 510 missing


async def test_reconcile_releases_the_hold(harness: Harness) -> None:
    limits = QuotaLimits(tpm=None, rpm=None, max_concurrent=1)
    reservation = await harness.reserve(limits, 10)
    await harness.deny(limits, 10)

    await harness.store.reconcile(reservation, limits, 10)

    assert (await harness.store.snapshot(TENANT, limits)).concurrent == 0
    await harness.reserve(limits, 10)


async def test_hold_expires_on_its_own(harness: Harness) -> None:
    limits = QuotaLimits(tpm=1000, rpm=None, max_concurrent=1)
    abandoned = await harness.reserve(limits, 100, hold_s=0.5)
    denial = await harness.deny(limits, 10)
    harness.assert_wait(denial.retry_after_s, 0.5)

    await harness.advance(0.6)

    assert (await harness.store.snapshot(TENANT, limits)).concurrent == 0
    await harness.reserve(limits, 10)
    # A late reconcile of the expired reservation settles tokens but frees no one else's slot.
    await harness.store.reconcile(abandoned, limits, 100)
    assert (await harness.store.snapshot(TENANT, limits)).concurrent == 1


async def test_holds_of_different_lengths_each_expire_at_their_own_time(
    harness: Harness,
) -> None:
    limits = QuotaLimits(tpm=None, rpm=None, max_concurrent=2)
    await harness.reserve(limits, 10, hold_s=3.0)
    await harness.reserve(limits, 10, hold_s=0.5)  # taken later, expires first
    await harness.deny(limits, 10)

    await harness.advance(0.6)
    await harness.reserve(limits, 10, hold_s=3.0)  # the short hold's slot, freed on its own
    await harness.deny(limits, 10)


def test_released_holds_leave_the_memory_store_no_backlog() -> None:
    """Each hold's expiry is also kept in a heap (dropping the expired ones costs what they
    are, not a scan of every hold); a released hold's entry stays there until it is rebuilt."""
    clock = FakeClock()
    store = MemoryQuotaStore(clock)
    limits = QuotaLimits(tpm=None, rpm=None, max_concurrent=None)

    async def churn() -> None:
        held = [await store.reserve(TENANT, limits, 1, HOLD_S) for _ in range(10)]
        for _ in range(1_000):  # a stream ends and the next starts, 10 always open
            finished = held.pop(0)
            assert isinstance(finished, Reservation)
            await store.reconcile(finished, limits, 1)
            held.append(await store.reserve(TENANT, limits, 1, HOLD_S))

    asyncio.run(churn())
    holds = store._tenants[TENANT].holds
    assert len(holds) == 10
    assert len(holds._by_expiry) <= 2 * len(holds) + 64

    clock.now += HOLD_S  # every hold expires, the released ones' entries are popped too
    asyncio.run(store.reserve(TENANT, limits, 1, HOLD_S))
    assert len(holds) == 1
    assert len(holds._by_expiry) == 1


async def test_unlimited_limits(harness: Harness) -> None:
    limits = QuotaLimits(tpm=None, rpm=None, max_concurrent=None)
    reservations = [await harness.reserve(limits, 10**9) for _ in range(3)]

    await harness.store.reconcile(reservations[0], limits, 10**10)

    assert await harness.store.snapshot(TENANT, limits) == QuotaSnapshot(
        limit_requests=None,
        remaining_requests=None,
        reset_requests_s=0.0,
        limit_tokens=None,
        remaining_tokens=None,
        reset_tokens_s=0.0,
        concurrent=2,
    )


async def test_snapshot_values(harness: Harness) -> None:
    limits = QuotaLimits(tpm=6000, rpm=60, max_concurrent=4)
    full = QuotaSnapshot(
        limit_requests=60,
        remaining_requests=60,
        reset_requests_s=0.0,
        limit_tokens=6000,
        remaining_tokens=6000,
        reset_tokens_s=0.0,
        concurrent=0,
    )
    assert await harness.store.snapshot(TENANT, limits) == full

    await harness.reserve(limits, 1000)
    await harness.advance(0.005)  # half a token: remaining counts whole tokens only

    snapshot = await harness.store.snapshot(TENANT, limits)
    assert (snapshot.limit_tokens, snapshot.limit_requests, snapshot.concurrent) == (6000, 60, 1)
    harness.assert_level(snapshot.remaining_tokens, 5000, 6000)
    harness.assert_wait(snapshot.reset_tokens_s, 10.0 - 0.005)
    harness.assert_level(snapshot.remaining_requests, 59, 60)
    harness.assert_wait(snapshot.reset_requests_s, 1.0 - 0.005)
    assert await harness.store.snapshot("someone-else", limits) == full


async def test_forget_drops_every_counter(harness: Harness) -> None:
    limits = QuotaLimits(tpm=1000, rpm=10, max_concurrent=2)
    await harness.reserve(limits, 500)
    await harness.store.reserve("other", limits, 500, HOLD_S)

    await harness.store.forget(TENANT)
    await harness.store.forget("never-seen")

    assert await harness.store.snapshot(TENANT, limits) == QuotaSnapshot(
        limit_requests=10,
        remaining_requests=10,
        reset_requests_s=0.0,
        limit_tokens=1000,
        remaining_tokens=1000,
        reset_tokens_s=0.0,
        concurrent=0,
    )
    other = await harness.store.snapshot("other", limits)
    harness.assert_level(other.remaining_tokens, 500, 1000)
    assert other.concurrent == 1


async def test_concurrent_reservations_never_over_admit_tokens(harness: Harness) -> None:
    limits = QuotaLimits(tpm=1000, rpm=None, max_concurrent=None)
    started = time.monotonic()

    results = await asyncio.gather(
        *(harness.store.reserve(TENANT, limits, 10, HOLD_S) for _ in range(200))
    )

    elapsed = time.monotonic() - started
    admitted = sum(isinstance(result, Reservation) for result in results)
    if harness.real_time:
        # Every reservation up to the capacity passes; later ones only on what refilled since.
        assert 100 <= admitted <= math.floor((1000 + 1000 / 60 * elapsed) / 10)
    else:
        assert admitted == 100


async def test_concurrent_reservations_never_over_admit_holds(harness: Harness) -> None:
    limits = QuotaLimits(tpm=None, rpm=None, max_concurrent=7)

    results = await asyncio.gather(
        *(harness.store.reserve(TENANT, limits, 1, HOLD_S) for _ in range(50))
    )

    assert sum(isinstance(result, Reservation) for result in results) == 7
    assert (await harness.store.snapshot(TENANT, limits)).concurrent == 7


async def test_invalid_arguments_are_refused(harness: Harness) -> None:
    limits = QuotaLimits(tpm=1000, rpm=None, max_concurrent=None)
    with pytest.raises(ValueError, match="tokens"):
        await harness.store.reserve(TENANT, limits, -1, HOLD_S)
    with pytest.raises(ValueError, match="hold_s"):
        await harness.store.reserve(TENANT, limits, 1, 0.0)
    reservation = await harness.reserve(limits, 10)
    with pytest.raises(ValueError, match="used_tokens"):
        await harness.store.reconcile(reservation, limits, -1)


# Redis only: the key layout, expiry and outages.


async def test_redis_keys_expire_after_a_full_refill(redis_url: str) -> None:
    prefix = f"test:{uuid4().hex}:"
    store = RedisQuotaStore(redis_url, key_prefix=prefix)
    raw = Redis.from_url(redis_url, decode_responses=True)
    try:
        await store.reserve(TENANT, QuotaLimits(tpm=1000, rpm=10, max_concurrent=2), 100, HOLD_S)
        keys = {key: await raw.pttl(key) for key in await raw.keys(f"{prefix}*")}

        base = f"{prefix}{{{TENANT}}}"
        assert set(keys) == {f"{base}:tokens", f"{base}:requests", f"{base}:holds"}
        # Full again after 6 s (tokens, requests) or 30 s (the hold), then a 120 s margin.
        assert 120_000 < keys[f"{base}:tokens"] <= 126_000
        assert 120_000 < keys[f"{base}:requests"] <= 126_000
        assert 144_000 < keys[f"{base}:holds"] <= 150_000

        await store.forget(TENANT)
        assert await raw.keys(f"{prefix}*") == []
    finally:
        await raw.aclose()
        await store.aclose()


async def test_redis_outage_fails_fast_and_recovers() -> None:
    limits = QuotaLimits(tpm=1000, rpm=10, max_concurrent=2)
    with running_redis() as server:
        store = RedisQuotaStore(server.url, timeout_s=0.5)
        try:
            await store.reserve(TENANT, limits, 10, HOLD_S)  # a pooled connection to break
            server.stop()

            for call in (
                lambda: store.reserve(TENANT, limits, 10, HOLD_S),
                lambda: store.snapshot(TENANT, limits),
                lambda: store.forget(TENANT),
            ):
                started = time.monotonic()
                with pytest.raises(StoreUnavailable) as caught:
                    await call()
                assert time.monotonic() - started < 1.5
                assert isinstance(caught.value.__cause__, RedisError | OSError)

            server.start()  # same port, empty data, empty script cache

            assert isinstance(await store.reserve(TENANT, limits, 10, HOLD_S), Reservation)
        finally:
            await store.aclose()


async def test_redis_that_stops_answering_times_out_and_recovers() -> None:
    limits = QuotaLimits(tpm=1000, rpm=10, max_concurrent=2)
    with running_redis() as server:
        store = RedisQuotaStore(server.url, timeout_s=0.5)
        try:
            await store.reserve(TENANT, limits, 10, HOLD_S)
            server.pause()

            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.reserve(TENANT, limits, 10, HOLD_S)
            assert time.monotonic() - started < 1.5

            server.resume()

            assert isinstance(await store.snapshot(TENANT, limits), QuotaSnapshot)
        finally:
            await store.aclose()

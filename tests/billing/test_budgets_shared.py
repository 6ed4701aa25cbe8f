"""Budgets shared by several gateway processes through Redis: two ``Billing`` services (two
processes) on one SQLite ledger and one real ``redis-server``. Refreshes are an hour apart, so
whatever one sees of the other's spend came through the counter, not the ledger."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from uuid import uuid4

import pytest
from redis.asyncio import Redis

from billing.records import UsageRecord
from billing.service import Billing, BillingConfig
from billing.spend_redis import RedisSpend, SpendStoreUnavailable
from billing.store import AccountSettings
from core.errors import BudgetExhaustedError, StoreUnavailableError
from tests.billing.records_factory import make_record
from tests.billing.test_service import NOW, PER_TOKEN_CARD, FakeClock
from tests.billing.waiting import wait_until
from tests.redis_server import RedisServer, running_redis
from tests.store_backends import delete_keys

TENANT = "acme"
BUDGET = 1000  # micros: ten tokens at PER_TOKEN_CARD's 100 micros each


class Processes:
    """Billing services over one ledger and one Redis, each with its own spool."""

    def __init__(self, tmp_path: Path, url: str) -> None:
        self.tmp_path = tmp_path
        self.url = url
        self.prefix = f"test:{uuid4().hex}:budget:"
        self.clock = FakeClock(NOW)
        self._running: list[Billing] = []
        self._ids = itertools.count()

    async def start(
        self, *, failure: str = "open", store_class: type[RedisSpend] = RedisSpend
    ) -> Billing:
        index = len(self._running)
        config = BillingConfig(
            sqlite_path=self.tmp_path / "ledger.db",
            spool_dir=self.tmp_path / f"spool-{index}",
            refresh_interval_s=3600.0,  # never within a test: only the counter can tell
            purge_interval_s=3600.0,
            flush_interval_s=0.05,
            spend_store_failure="closed" if failure == "closed" else "open",
            spend_store_retry_after_s=1.0,
        )
        store = store_class(
            self.url, source=f"process-{index}", key_prefix=self.prefix, timeout_s=0.5
        )
        service = Billing(config, clock_us=self.clock, spend_store=store)
        await service.start()
        self._running.append(service)
        return service

    def spend(self, service: Billing, tokens: int, tenant_id: str = TENANT) -> UsageRecord:
        record = make_record(
            record_id=f"r{next(self._ids)}", tenant_id=tenant_id, prompt_tokens=0,
            cached_tokens=0, completion_tokens=tokens, started_at_us=NOW - 1, finished_at_us=NOW,
        )  # fmt: skip
        recorded = service.record(record)
        assert recorded.cost_micros == 100 * tokens
        return recorded

    async def counter(self) -> int | None:
        """The tenant's total in Redis, read directly."""
        raw = Redis.from_url(self.url, decode_responses=True)
        try:
            value = await raw.hget(f"{self.prefix}{{2026-11}}:spend", TENANT)
        finally:
            await raw.aclose()
        return None if value is None else int(value)

    async def stop_all(self) -> None:
        for service in self._running:
            await service.aclose()
        await delete_keys(self.url, self.prefix)


async def two_with_a_budget(processes: Processes) -> tuple[Billing, Billing]:
    first = await processes.start()
    await first.add_price_card(PER_TOKEN_CARD)
    await first.put_account(
        AccountSettings(TENANT, monthly_budget_micros=BUDGET, alert_thresholds_pct=(50, 100))
    )
    second = await processes.start()  # reads the card and the budget at start
    assert second.budget_status(TENANT).budget_micros == BUDGET
    return first, second


def spent(service: Billing) -> int:
    return service.budget_status(TENANT).spend_micros


@pytest.fixture
async def processes(tmp_path: Path, redis_url: str) -> AsyncIterator[Processes]:
    running = Processes(tmp_path, redis_url)
    yield running
    await running.stop_all()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A server of the test's own, to restart (it keeps no data across one)."""
    with running_redis() as server:
        yield server


async def test_spend_of_one_process_is_seen_by_the_other_without_a_refresh(
    processes: Processes,
) -> None:
    first, second = await two_with_a_budget(processes)
    processes.spend(first, 3)
    assert spent(first) == 300  # its own at once, before Redis has it
    await wait_until(lambda: spent(second) == 300, "the second process sees the first's spend")
    processes.spend(second, 2)
    await wait_until(lambda: spent(first) == 500, "the first process sees the second's spend")
    assert spent(second) == 500
    await wait_until(lambda: first.spend_sync is not None and first.spend_sync.up, "listening")
    assert await processes.counter() == 500  # neither counted twice


async def test_a_budget_is_refused_at_the_exact_point_in_both_processes(
    processes: Processes,
) -> None:
    first, second = await two_with_a_budget(processes)
    for service, tokens in ((first, 3), (second, 3), (first, 3)):
        service.check_budget(TENANT)
        processes.spend(service, tokens)
    await wait_until(lambda: spent(first) == spent(second) == 900, "both see 900")
    first.check_budget(TENANT)
    second.check_budget(TENANT)  # 100 left: still admitted
    processes.spend(second, 1)  # exactly the budget
    with pytest.raises(BudgetExhaustedError, match="monthly budget"):
        second.check_budget(TENANT)
    await wait_until(lambda: spent(first) == 1000, "the first sees the last 100")
    with pytest.raises(BudgetExhaustedError):
        first.check_budget(TENANT)
    first.check_budget("globex")  # no budget: never refused


async def test_alert_levels_fire_once_across_processes(processes: Processes) -> None:
    first, second = await two_with_a_budget(processes)
    processes.spend(first, 4)
    processes.spend(second, 4)  # 800: 50 % crossed in whichever process saw it first
    await wait_until(lambda: spent(first) == spent(second) == 800, "both see 800")
    processes.spend(first, 2)  # 1000: 100 %
    await wait_until(lambda: spent(second) == 1000, "the second sees 1000")
    for level in (50, 100):
        await wait_until(
            lambda level=level: any(
                (TENANT, level) in s.alert_stats.fired for s in (first, second)
            ),  # type: ignore[misc]
            f"the {level} % alert",
        )
    await first.refresh()
    await second.refresh()
    fired = [
        s.alert_stats.fired.get((TENANT, level), 0) for s in (first, second) for level in (50, 100)
    ]
    assert sum(fired) == 2, fired
    stored = sorted(a.threshold_pct for a in first.store.alerts(TENANT, 0))
    assert stored == [50, 100]


async def test_the_counter_is_seeded_again_from_the_ledger_after_redis_lost_it(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    processes = Processes(tmp_path, own_redis.url)
    try:
        first, second = await two_with_a_budget(processes)
        processes.spend(first, 3)
        processes.spend(second, 2)
        await wait_until(lambda: spent(first) == spent(second) == 500, "both see 500")
        await first.flush()
        await second.flush()  # the ledger has all 500

        own_redis.stop()
        own_redis.start()  # empty: no persistence
        assert await processes.counter() is None
        processes.spend(first, 1)  # refused by the empty month: seeded from the ledger first
        assert spent(first) == 600
        # Not 100 (from zero) and not 1100 (the ledger's 600 plus the pending 100 again).
        await wait_until_counter(processes, 600)
        processes.spend(second, 1)
        await wait_until_counter(processes, 700)
        await wait_until(lambda: spent(first) == spent(second) == 700, "both see 700")
    finally:
        await processes.stop_all()


class FloorFailing(RedisSpend):
    """The real counter, whose ``floor`` (a reconcile's first call) fails as a timed-out call
    would while ``failing`` is set."""

    failing = True
    failures = 0

    async def floor(self, month: str, floors: dict[str, int]) -> bool:
        if FloorFailing.failing:
            FloorFailing.failures += 1
            raise SpendStoreUnavailable("timed out (the test's)")
        return await super().floor(month, floors)


async def test_a_reconcile_redis_failed_is_tried_again_before_the_next_refresh(
    processes: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A month missing from the counter is seeded only by a reconcile; one that failed is tried
    again on the spend sync's backoff, so spend reaches the counter soon after Redis answers,
    not a refresh interval (an hour here) later."""
    monkeypatch.setattr(FloorFailing, "failing", True)
    monkeypatch.setattr(FloorFailing, "failures", 0)
    first = await processes.start(store_class=FloorFailing)
    await first.add_price_card(PER_TOKEN_CARD)
    await wait_until(lambda: first.spend_sync is not None and first.spend_sync.up, "listening")
    failed = FloorFailing.failures
    processes.spend(first, 3)  # the push finds the month missing and asks for the seed
    await wait_until(lambda: FloorFailing.failures > failed, "the seed's reconcile failed")
    FloorFailing.failing = False  # nothing else happens here to ask for it again
    await wait_until_counter(processes, 300)


async def wait_until_counter(processes: Processes, expected: int) -> None:
    """Until Redis holds ``expected`` for the tenant (a hang guard: 10 s)."""
    seen = None
    for _ in range(500):
        seen = await processes.counter()
        if seen == expected:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the counter is {seen}, expected {expected}")


async def test_closed_policy_refuses_budgeted_tenants_while_redis_is_down(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    processes = Processes(tmp_path, own_redis.url)
    try:
        first = await processes.start(failure="closed")
        await first.put_account(AccountSettings(TENANT, monthly_budget_micros=BUDGET))
        await wait_until(lambda: first.spend_sync is not None and first.spend_sync.up, "up")
        first.check_budget(TENANT)
        own_redis.stop()
        await wait_until(lambda: first.spend_sync is not None and not first.spend_sync.up, "down")
        with pytest.raises(StoreUnavailableError):
            first.check_budget(TENANT)
        first.check_budget("globex")  # no budget: no counter needed
        own_redis.start()
        await wait_until(lambda: first.spend_sync is not None and first.spend_sync.up, "back")
        first.check_budget(TENANT)
    finally:
        await processes.stop_all()

"""Billing, the service: pricing by the card in effect when a request ended, budgets refused at
admission, alerts stored once across gateways, the request log's retention, usage pages. A real
SQLite ledger in ``tmp_path`` and a fake clock."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import billing.service
from billing.prices import PriceCard, PriceError
from billing.records import UsageRecord, to_unix_us
from billing.service import Billing, BillingConfig
from billing.sql_store import SqliteLedgerStore
from billing.store import AccountSettings, BudgetAlert, Cursor, UsageQuery
from core.errors import BudgetExhaustedError, QuotaExhaustedError
from tests.billing.records_factory import HOUR_US, make_record, make_records
from tests.billing.waiting import returns, wait_until

NOW = to_unix_us(datetime(2026, 11, 10, 9, tzinfo=UTC))
DECEMBER = to_unix_us(datetime(2026, 12, 1, tzinfo=UTC))
MINUTE_US = 60_000_000
ALL_TIME = UsageQuery(0, 2**62)
VERSION = "llama-3.1-8b@a1"  # make_record's model version


class FakeClock:
    def __init__(self, now_us: int) -> None:
        self.now_us = now_us

    def __call__(self) -> int:
        return self.now_us


class Gateways:
    """Billing instances on one SQLite ledger, each with its own spool (one per gateway)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.ledger = tmp_path / "ledger.db"
        self._running: list[Billing] = []
        self._names = itertools.count()

    async def start(self, clock: FakeClock, store: SqliteLedgerStore | None = None) -> Billing:
        config = BillingConfig(
            sqlite_path=self.ledger,
            spool_dir=self.tmp_path / f"spool-{next(self._names)}",
            refresh_interval_s=3600.0,  # refreshes are the test's to make (or an alert's)
            purge_interval_s=3600.0,
            flush_interval_s=0.05,
        )
        store = store or SqliteLedgerStore(self.ledger)
        service = Billing(config, store=store, clock_us=clock)
        await service.start()
        self._running.append(service)
        return service

    async def stop(self, service: Billing) -> None:
        self._running.remove(service)
        await service.aclose()

    async def stop_all(self) -> None:
        for service in list(self._running):
            await self.stop(service)


@pytest.fixture
async def gateways(tmp_path: Path) -> AsyncIterator[Gateways]:
    running = Gateways(tmp_path)
    yield running
    await running.stop_all()


async def stored(service: Billing) -> dict[str, UsageRecord]:
    """Every record in the ledger (after a flush), by id."""
    return {record.record_id: record async for page in service.usage(ALL_TIME) for record in page}


def card(
    effective_from_us: int, scale: int = 1, version: str = VERSION, **prices: str
) -> PriceCard:
    return PriceCard(
        version,
        effective_from_us,
        Decimal(prices.get("input", "0.00015")) * scale,
        Decimal(prices.get("output", "0.0006")) * scale,
        Decimal(prices.get("cached", "0.000075")) * scale,
    )


# --- pricing ---------------------------------------------------------------------------------


async def test_records_are_priced_by_the_card_in_effect_when_they_ended(gateways: Gateways) -> None:
    clock = FakeClock(NOW)
    service = await gateways.start(clock)
    await service.add_price_card(card(NOW))
    # 600 uncached, 400 cached prompt tokens and 200 completion tokens (make_record's counts).
    before = service.record(make_record(record_id="before", finished_at_us=NOW - 1))
    assert (before.cost_micros, before.price_effective_from_us, before.currency) == (0, None, "USD")
    first = service.record(make_record(record_id="first", finished_at_us=NOW + HOUR_US))
    assert (first.cost_micros, first.price_effective_from_us) == (240, NOW)
    assert await service.writer.flush() is True
    assert (await stored(service))["first"] == first

    clock.now_us = NOW + 2 * HOUR_US
    await service.add_price_card(card(NOW + 3 * HOUR_US, scale=2))
    # Ended before the new card takes effect: still the old price, even recorded after it.
    late = service.record(make_record(record_id="late", finished_at_us=NOW + 2 * HOUR_US + 1))
    after = service.record(make_record(record_id="after", finished_at_us=NOW + 3 * HOUR_US))
    assert (late.cost_micros, late.price_effective_from_us) == (240, NOW)
    assert (after.cost_micros, after.price_effective_from_us) == (480, NOW + 3 * HOUR_US)

    await service.refresh()  # prices re-read from the ledger: nothing already billed changes
    in_ledger = await stored(service)
    assert in_ledger == {r.record_id: r for r in (before, first, late, after)}
    assert [c.effective_from_us for c in service.store.price_cards()] == [NOW, NOW + 3 * HOUR_US]


async def test_a_card_effective_in_the_past_is_refused(gateways: Gateways) -> None:
    clock = FakeClock(NOW)
    service = await gateways.start(clock)
    with pytest.raises(PriceError, match="past"):
        await service.add_price_card(card(NOW - HOUR_US))
    assert service.store.price_cards() == []
    assert service.record(make_record(finished_at_us=NOW)).cost_micros == 0


async def test_unpriced_versions_cost_nothing_and_costs_round_half_up(gateways: Gateways) -> None:
    service = await gateways.start(FakeClock(NOW))
    await service.add_price_card(
        card(NOW, version="tiny@1", input="0", output="0.0015", cached="0")
    )
    # One completion token at 0.0015 per 1k is 1.5 micros: rounded half-up, once.
    tiny = make_record(
        record_id="tiny", model_version="tiny@1", prompt_tokens=0, cached_tokens=0,
        completion_tokens=1, finished_at_us=NOW,
    )  # fmt: skip
    assert service.record(tiny).cost_micros == 2
    unpriced = service.record(
        make_record(record_id="unpriced", model_version="mistral-7b@d4", finished_at_us=NOW)
    )
    assert (unpriced.cost_micros, unpriced.price_effective_from_us) == (0, None)
    assert unpriced.currency == "USD"
    assert (await stored(service))["unpriced"] == unpriced


# --- budgets and alerts ----------------------------------------------------------------------


class Spender:
    """Records of ``tokens`` completion tokens at 100 micros each (the prompt is free)."""

    def __init__(self, service: Billing, clock: FakeClock) -> None:
        self.service = service
        self.clock = clock
        self._ids = itertools.count()

    def spend(self, tenant_id: str, tokens: int) -> UsageRecord:
        record = make_record(
            record_id=f"{tenant_id}-{id(self.service)}-{next(self._ids)}",
            tenant_id=tenant_id, prompt_tokens=0, cached_tokens=0, completion_tokens=tokens,
            started_at_us=self.clock.now_us - 1, finished_at_us=self.clock.now_us,
        )  # fmt: skip
        recorded = self.service.record(record)
        assert recorded.cost_micros == 100 * tokens
        return recorded


PER_TOKEN_CARD = card(NOW, input="0", output="0.1", cached="0")  # 100 micros per output token


async def test_budget_is_refused_once_spent_and_alerts_fire_once(
    gateways: Gateways, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tandem.billing")
    clock = FakeClock(NOW)
    service = await gateways.start(clock)
    await service.add_price_card(PER_TOKEN_CARD)
    await service.put_account(AccountSettings("acme", monthly_budget_micros=1000))
    spender = Spender(service, clock)

    service.check_budget("acme")
    spender.spend("acme", 4)
    assert service.alert_stats.fired == {}
    spender.spend("acme", 1)  # 500 of 1000: 50 %
    await wait_until(lambda: ("acme", 50) in service.alert_stats.fired, "the 50 % alert")
    spender.spend("acme", 4)  # 900: 80 %
    service.check_budget("acme")
    await wait_until(lambda: ("acme", 80) in service.alert_stats.fired, "the 80 % alert")
    spender.spend("globex", 1000)  # no budget: never refused
    service.check_budget("globex")
    clock.now_us += MINUTE_US
    spender.spend("acme", 1)  # 1000: spent
    with pytest.raises(BudgetExhaustedError) as refused:
        service.check_budget("acme")
    error = refused.value
    assert isinstance(error, QuotaExhaustedError)
    assert (error.status_code, error.code, error.should_retry) == (429, "insufficient_quota", False)
    assert error.headers()["x-should-retry"] == "false"
    assert error.to_body()["error"]["type"] == "insufficient_quota"
    assert "2026-11" in error.message

    expected = {("acme", 50): 1, ("acme", 80): 1, ("acme", 100): 1}
    await wait_until(lambda: service.alert_stats.fired == expected, "the 100 % alert")
    spender.spend("acme", 3)  # past 100 %: nothing more to announce
    await gateways.stop(service)
    assert service.alert_stats.fired == expected
    alerts = service.store.alerts("acme", 0)
    assert [(a.threshold_pct, a.spend_micros, a.budget_micros) for a in alerts] == [
        (50, 500, 1000),
        (80, 900, 1000),
        (100, 1000, 1000),
    ]
    assert [a.fired_at_us for a in alerts] == [NOW, NOW, NOW + MINUTE_US]
    announced = [r.getMessage() for r in caplog.records if "budget alert" in r.getMessage()]
    assert len(announced) == 3
    assert all(r.levelno == logging.WARNING for r in caplog.records if "budget alert" in r.msg)
    assert "tenant acme reached 100% of its 2026-11 budget (0.001 of 0.001 USD)" in announced[-1]


async def test_the_budget_renews_with_the_month(gateways: Gateways) -> None:
    clock = FakeClock(NOW)
    service = await gateways.start(clock)
    await service.add_price_card(PER_TOKEN_CARD)
    await service.put_account(AccountSettings("acme", monthly_budget_micros=1000))
    spender = Spender(service, clock)
    spender.spend("acme", 10)
    with pytest.raises(BudgetExhaustedError):
        service.check_budget("acme")
    await service.refresh()
    with pytest.raises(BudgetExhaustedError):
        service.check_budget("acme")  # the spend is stored now, not only local
    clock.now_us = DECEMBER
    service.check_budget("acme")
    assert service.budget_status("acme").spend_micros == 0
    await service.refresh()
    assert service.budget_status("acme").spend_micros == 0
    spender.spend("acme", 10)
    with pytest.raises(BudgetExhaustedError):
        service.check_budget("acme")


async def test_another_gateway_sees_spend_after_a_refresh_and_not_the_stored_alert(
    gateways: Gateways, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tandem.billing")
    clock = FakeClock(NOW)
    first = await gateways.start(clock)
    await first.add_price_card(PER_TOKEN_CARD)
    await first.put_account(AccountSettings("acme", monthly_budget_micros=2000))
    second = await gateways.start(clock)  # started after the card and the budget: has them
    assert second.budget_status("acme").budget_micros == 2000

    Spender(first, clock).spend("acme", 11)  # 1100: 50 %, announced by the first gateway
    await wait_until(lambda: ("acme", 50) in first.alert_stats.fired, "the first gateway's alert")
    assert second.budget_status("acme").spend_micros == 0  # not refreshed yet
    # The second gateway's own records cross 50 % of what it knows before it refreshes: the
    # level is the first gateway's already, so the second one announces nothing.
    Spender(second, clock).spend("acme", 10)
    await second.refresh()
    assert second.budget_status("acme").spend_micros == 2100
    with pytest.raises(BudgetExhaustedError):
        second.check_budget("acme")
    first.check_budget("acme")  # it has not refreshed: 1100 is all it knows
    await first.refresh()
    with pytest.raises(BudgetExhaustedError):
        first.check_budget("acme")

    await gateways.stop(second)
    assert ("acme", 50) not in second.alert_stats.fired
    [alert] = [a for a in first.store.alerts("acme", 0) if a.threshold_pct == 50]
    assert alert.spend_micros == 1100  # stored once, by the first gateway
    messages = [r.getMessage() for r in caplog.records if "budget alert" in r.getMessage()]
    assert len([m for m in messages if "reached 50%" in m]) == 1


async def test_levels_crossed_by_other_gateways_spend_fire_after_a_refresh(
    gateways: Gateways,
) -> None:
    """The budget is spent by two gateways together: neither saw 80 % or 100 % in its own
    records, and once it is spent no request is admitted to record another. The refresh that
    reads the total must fire those levels (once, on whichever gateway gets there first)."""
    clock = FakeClock(NOW)
    first = await gateways.start(clock)
    await first.add_price_card(PER_TOKEN_CARD)
    await first.put_account(AccountSettings("acme", monthly_budget_micros=1000))
    second = await gateways.start(clock)
    Spender(first, clock).spend("acme", 6)
    Spender(second, clock).spend("acme", 5)
    await first.writer.flush()
    await second.refresh()  # 1100 of 1000
    await first.refresh()
    with pytest.raises(BudgetExhaustedError):
        second.check_budget("acme")

    def announced() -> dict[tuple[str, int], int]:
        counts: dict[tuple[str, int], int] = {}
        for service in (first, second):
            for key, count in service.alert_stats.fired.items():
                counts[key] = counts.get(key, 0) + count
        return counts

    expected = {("acme", 50): 1, ("acme", 80): 1, ("acme", 100): 1}
    await wait_until(lambda: announced() == expected, "80 % and 100 % announced", timeout_s=5)
    await gateways.stop(second)
    await gateways.stop(first)
    assert [a.threshold_pct for a in first.store.alerts("acme", 0)] == [50, 80, 100]
    assert announced() == expected


async def test_a_refreshed_gateway_does_not_fire_stored_alerts_again(gateways: Gateways) -> None:
    clock = FakeClock(NOW)
    first = await gateways.start(clock)
    await first.add_price_card(PER_TOKEN_CARD)
    await first.put_account(AccountSettings("acme", monthly_budget_micros=1000))
    Spender(first, clock).spend("acme", 9)
    expected = {("acme", 50): 1, ("acme", 80): 1}
    await wait_until(lambda: first.alert_stats.fired == expected, "the first gateway's alerts")
    assert await first.writer.flush() is True

    second = await gateways.start(clock)  # its start-up refresh reads spend and fired alerts
    assert second.budget_status("acme").spend_micros == 900
    Spender(second, clock).spend("acme", 1)  # 1000: only the 100 % level is new
    await wait_until(lambda: ("acme", 100) in second.alert_stats.fired, "the 100 % alert")
    await gateways.stop(second)
    assert second.alert_stats.fired == {("acme", 100): 1}
    assert [a.threshold_pct for a in first.store.alerts("acme", 0)] == [50, 80, 100]


# --- request log -----------------------------------------------------------------------------


async def test_request_log_kept_only_when_enabled_and_purged_after_retention(
    gateways: Gateways,
) -> None:
    clock = FakeClock(NOW)
    service = await gateways.start(clock)
    await service.put_account(
        AccountSettings("acme", request_log=True, request_log_retention_s=3600)
    )
    await service.put_account(AccountSettings("initech", request_log=False))
    assert service.request_log_retention_s("acme") == 3600
    assert service.request_log_retention_s("globex") is None
    kept = service.record(make_record(record_id="kept", finished_at_us=NOW), ("prompt", "output"))
    service.record(make_record(record_id="no-text", finished_at_us=NOW + 1))
    for tenant in ("globex", "initech"):
        record = make_record(record_id=f"{tenant}-1", tenant_id=tenant, finished_at_us=NOW)
        service.record(record, ("secret prompt", "secret output"))

    [entry] = await service.request_log("acme", 0, 2**62, 100)
    assert (entry.record_id, entry.request_id, entry.prompt, entry.output) == (
        "kept", kept.request_id, "prompt", "output",
    )  # fmt: skip
    assert (entry.created_at_us, entry.expires_at_us) == (NOW, NOW + 3600 * 1_000_000)
    assert await service.request_log("globex", 0, 2**62, 100) == []
    assert await service.request_log("initech", 0, 2**62, 100) == []
    assert len(await stored(service)) == 4  # every record is billed, kept text or not

    # The first purge after a start runs at once (whatever the host's uptime); the entry has
    # one microsecond left.
    clock.now_us = entry.expires_at_us - 1
    await service._purge_request_log()
    assert len(await service.request_log("acme", 0, 2**62, 100)) == 1
    # Expired now, but the next purge is one purge interval (3600 s) after the last one.
    clock.now_us = entry.expires_at_us
    await service._purge_request_log()
    assert len(await service.request_log("acme", 0, 2**62, 100)) == 1
    clock.now_us = entry.expires_at_us - 1 + 3600 * 1_000_000
    await service._purge_request_log()
    assert await service.request_log("acme", 0, 2**62, 100) == []


async def test_the_first_refresh_after_a_start_purges_expired_request_logs(
    gateways: Gateways,
) -> None:
    """Entries that expired while no gateway ran go at the first refresh, not an hour later."""
    clock = FakeClock(NOW)
    first = await gateways.start(clock)
    await first.put_account(AccountSettings("acme", request_log=True, request_log_retention_s=60))
    first.record(make_record(record_id="old", finished_at_us=NOW), ("prompt", "output"))
    assert len(await first.request_log("acme", 0, 2**62, 100)) == 1
    await gateways.stop(first)

    clock.now_us = NOW + 61 * 1_000_000
    second = await gateways.start(clock)
    second._wake.set()  # the refresher's next round, without waiting out its interval
    await wait_until(
        lambda: second.store.request_log("acme", 0, 2**62, 100) == [],
        "the expired entry purged by the first refresh",
    )


# --- usage pages -----------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 49, 50])
async def test_usage_pages_are_ordered_and_complete(
    gateways: Gateways, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    monkeypatch.setattr(billing.service, "PAGE_SIZE", 7)
    service = await gateways.start(FakeClock(NOW))
    recorded = [service.record(record) for record in make_records(count)[::-1]]
    # No flush: usage() writes what was recorded before it reads.
    pages = [page async for page in service.usage(ALL_TIME)]
    assert [len(page) for page in pages] == [7] * (count // 7) + ([count % 7] if count % 7 else [])
    records = [record for page in pages for record in page]
    assert records == sorted(recorded, key=lambda r: (r.finished_at_us, r.record_id))
    acme: list[Any] = [
        r async for page in service.usage(UsageQuery(0, 2**62, "acme")) for r in page
    ]
    assert acme == [record for record in records if record.tenant_id == "acme"]
    assert service.store.usage_page(ALL_TIME, Cursor(2**62, ""), 7) == []


async def test_aclose_right_after_an_alert_woke_the_refresher(gateways: Gateways) -> None:
    """The wake-up and the cancellation land in the same loop iteration: the cancellation must
    not be lost (asyncio.wait_for on Python 3.11 returns the finished wait instead)."""
    clock = FakeClock(NOW)
    service = await gateways.start(clock)
    await service.add_price_card(PER_TOKEN_CARD)
    await service.put_account(AccountSettings("acme", monthly_budget_micros=1000))
    Spender(service, clock).spend("acme", 5)  # 50 %: wakes the refresher
    await returns(gateways.stop(service), "aclose")
    assert [a.threshold_pct for a in service.store.alerts("acme", 0)] == [50]


class SlowAlertStore(SqliteLedgerStore):
    """Holds ``add_alert`` on the ledger thread until the test releases it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.entered = threading.Event()
        self.release = threading.Event()

    def add_alert(self, alert: BudgetAlert) -> bool:
        self.entered.set()
        self.release.wait(10)
        return super().add_alert(alert)


async def test_an_alert_stored_while_the_gateway_stops_is_still_announced(
    gateways: Gateways,
) -> None:
    """aclose() cancels the refresher while its add_alert runs on the ledger thread: the insert
    commits anyway, so the retry in aclose() finds the alert stored, and must not take it for
    another gateway's and leave it unannounced."""
    clock = FakeClock(NOW)
    store = SlowAlertStore(gateways.ledger)
    service = await gateways.start(clock, store)
    await service.add_price_card(PER_TOKEN_CARD)
    await service.put_account(AccountSettings("acme", monthly_budget_micros=1000))
    Spender(service, clock).spend("acme", 5)  # 50 %: wakes the refresher
    await wait_until(store.entered.is_set, "the refresher storing the alert")
    stopping = asyncio.create_task(gateways.stop(service))
    await asyncio.sleep(0)  # aclose() cancels the refresher mid-insert
    store.release.set()
    await returns(stopping, "aclose")
    assert [a.threshold_pct for a in store.alerts("acme", 0)] == [50]
    assert service.alert_stats.fired == {("acme", 50): 1}

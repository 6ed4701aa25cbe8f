"""``Billing``: the one object the gateway holds for everything money.

record(record)            price it (the card in effect when it ended), count it against the
                          tenant's budget and the cost meter, hand it to the writer
check_budget(tenant)      at admission: 429 insufficient_quota once this month's budget is spent
refresher (task)          every ``refresh_interval_s``: flush, re-read spend, prices and
                          settings (other gateways' changes), store and announce new alerts,
                          delete request-log entries past their retention; with a shared spend
                          counter, raise it to the ledger's figures or seed a missing month
                          (when Redis failed that, again on the spend sync's backoff: 0.1 s
                          doubling to 5 s, not a refresh interval later)
spend sync (tasks)        with a shared spend counter (Redis, several gateways): push this
                          gateway's spend to it and follow the others' (``billing/spend_sync.py``)
admin side                price cards, account settings, budget status, alerts, usage pages
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from billing.budgets import BudgetGuard, BudgetStatus
from billing.cost import CostMeter, WorkerCost
from billing.prices import PriceBook, PriceCard, PriceError
from billing.records import UsageRecord, from_unix_us
from billing.spend_redis import RedisSpend, SpendStoreUnavailable
from billing.spend_sync import SpendSync, next_retry_s
from billing.sql_store import open_store
from billing.store import (
    AccountSettings,
    BudgetAlert,
    Cursor,
    LedgerStore,
    LedgerUnavailableError,
    RequestLogEntry,
    UsageQuery,
)
from billing.summaries import month_of
from billing.writer import LedgerWriter, WriterConfig
from core.errors import BudgetExhaustedError, StoreUnavailableError

log = logging.getLogger("tandem.billing")

PAGE_SIZE = 2000


def now_us() -> int:
    """Wall-clock Unix microseconds."""
    return time.time_ns() // 1000


def month_key(at_us: int) -> str:
    """``YYYY-MM`` (UTC) of a time."""
    return _month_of_day(at_us // _MICROS_PER_DAY)


_MICROS_PER_DAY = 86_400 * 1_000_000


@functools.lru_cache(maxsize=64)
def _month_of_day(day: int) -> str:
    # Every record asks: a datetime formatted per record showed in the per-request profile.
    return from_unix_us(day * _MICROS_PER_DAY).strftime("%Y-%m")


@dataclass(frozen=True, slots=True)
class BillingConfig:
    """Where the ledger lives and how often gateways re-read it."""

    sqlite_path: Path
    """The embedded ledger (SQLite, WAL) when ``database_url`` is unset."""
    spool_dir: Path
    """Where records wait on disk until the database has them."""
    database_url: str | None = None
    """``postgresql://...`` for a ledger shared by several gateways."""
    currency: str = "USD"
    """The currency of costs, budgets and price cards."""
    refresh_interval_s: float = 5.0
    """How often spend, prices and settings are re-read (other gateways' changes)."""
    purge_interval_s: float = 3600.0
    """How often request-log entries past their retention are deleted."""
    flush_interval_s: float = 0.2
    """Longest time a record waits in memory before it is written."""
    worker_micros_per_hour: int = 0
    """What one worker's hardware costs per hour (micro-units), for the measured cost."""
    worker_micros_per_hour_by_name: tuple[tuple[str, int], ...] = ()
    """Per-worker prices that differ from ``worker_micros_per_hour`` (by worker name)."""
    telemetry_interval_s: float = 5.0
    """How often GPUs (NVML) or the host are sampled for the workers' busy time."""
    spend_store_failure: Literal["open", "closed"] = "open"
    """With a shared spend counter that cannot be reached: ``open`` checks budgets against
    this gateway's view (the ledger's last refresh plus its own spend), ``closed`` refuses
    tenants that have a budget with 503 until it answers (the quota store's policy)."""
    spend_store_retry_after_s: float = 2.0
    """Retry hint on those 503s."""

    def worker_price(self, worker: str) -> int:
        """Micro-units per hour of ``worker``."""
        return dict(self.worker_micros_per_hour_by_name).get(worker, self.worker_micros_per_hour)

    def worker_cost(self, worker: str, deployment: str, model_version: str) -> WorkerCost:
        """``worker``'s price as the cost meter keys it: under the version it serves."""
        return WorkerCost(worker, deployment, model_version, self.worker_price(worker))


@dataclass(slots=True)
class AlertStats:
    """Alerts this gateway announced, by threshold (for ``/metrics``)."""

    fired: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)


class Billing:
    """Owns the ledger writer and the refresher; used on the event loop only."""

    def __init__(
        self,
        config: BillingConfig,
        store: LedgerStore | None = None,
        cost_meter: CostMeter | None = None,
        clock_us: Callable[[], int] = now_us,
        spend_store: RedisSpend | None = None,
    ) -> None:
        """``spend_store``: the spend counter shared by several gateways (Redis); without it
        budgets see other gateways' spend at each refresh only."""
        self.config = config
        self.store = store or open_store(config.database_url, config.sqlite_path)
        self.writer = LedgerWriter(
            self.store,
            WriterConfig(spool_dir=config.spool_dir, flush_interval_s=config.flush_interval_s),
        )
        self.cost_meter = cost_meter
        self._clock_us = clock_us
        self.prices = PriceBook()
        self._wake = asyncio.Event()
        self.budgets = BudgetGuard(month_key(clock_us()), shared=spend_store is not None)
        self.spend_sync = None
        if spend_store is not None:
            self.spend_sync = SpendSync(
                spend_store,
                self.budgets,
                on_raised=self._on_shared_spend,
                request_seed=self._wake.set,
            )
        self.alert_stats = AlertStats()
        self._unannounced: list[BudgetAlert] = []
        self._task: asyncio.Task[None] | None = None
        self._next_purge_us: int | None = None
        self._reconcile_retry_s: float | None = None
        """Set while the last reconcile failed: the refresher runs again this soon. A month
        missing from Redis is seeded only there, and the spend pending until then is not
        pushed."""

    def price_worker(
        self,
        worker: str,
        deployment: str,
        model_version: str,
        micros_per_hour: int | None = None,
    ) -> None:
        """Measure the cost of a worker deployed after start (a new version's), at
        ``micros_per_hour`` (what its deployment was given: other hardware) or else its
        configured price; nothing without a cost meter."""
        if self.cost_meter is None:
            return
        cost = self.config.worker_cost(worker, deployment, model_version)
        if micros_per_hour is not None:
            cost = WorkerCost(worker, deployment, model_version, micros_per_hour)
        self.cost_meter.add_worker(cost)

    def price_like(self, worker: str, sibling: str) -> bool:
        """Measure a worker added to a running pool (the planner's) at the price of
        ``sibling``, a worker of the same pool; False (nothing done) without a cost meter or
        that price."""
        price = None if self.cost_meter is None else self.cost_meter.price_of(sibling)
        if self.cost_meter is None or price is None:
            return False
        self.cost_meter.add_worker(dataclasses.replace(price, worker=worker))
        return True

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the writer (schema, spool replay) and read prices, settings and spend."""
        await self.writer.start()
        with contextlib.suppress(LedgerUnavailableError):
            await self.refresh()
        if self.spend_sync is not None:
            self.spend_sync.start()
        self._task = asyncio.create_task(self._run(), name="billing-refresher")

    async def aclose(self) -> None:
        """Stop refreshing, then write (or spool) every record."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.spend_sync is not None:
            await self.spend_sync.aclose()
        with contextlib.suppress(LedgerUnavailableError):
            await self._announce_alerts()
        await self.writer.aclose()

    # -- the request path ------------------------------------------------------------------

    def check_budget(self, tenant_id: str) -> None:
        """Refuse a tenant whose budget for this month is spent (429, not to be retried)."""
        self._roll_month()
        status = self.budgets.status(tenant_id)
        if (
            status.budget_micros is not None
            and self.spend_sync is not None
            and not self.spend_sync.up
            and self.config.spend_store_failure == "closed"
        ):
            raise StoreUnavailableError(
                "Budget checks are temporarily unavailable; retry shortly.",
                retry_after_s=self.config.spend_store_retry_after_s,
            )
        if status.exhausted and status.budget_micros is not None:
            raise BudgetExhaustedError(
                f"You exceeded your monthly budget ({_money(status.budget_micros)} "
                f"{self.config.currency}, spent {_money(status.spend_micros)}) for "
                f"{status.month}. It renews at the start of next month (UTC); ask your "
                "administrator to raise it.",
                should_retry=False,
            )

    def request_log_retention_s(self, tenant_id: str) -> int | None:
        """How long this tenant's prompts and outputs are kept; None: not kept."""
        account = self.budgets.account(tenant_id)
        return account.request_log_retention_s if account.request_log else None

    def record(
        self, record: UsageRecord, prompt_output: tuple[str, str] | None = None
    ) -> UsageRecord:
        """Price and keep one request's record (with its scrubbed prompt and output for a
        tenant that keeps a request log). Never blocks and never raises on the database."""
        card = self.prices.card_for(record.model_version, record.finished_at_us)
        if card is not None:
            cost = card.cost_micros(
                record.prompt_tokens, record.completion_tokens, record.cached_tokens
            )
            record = dataclasses.replace(
                record,
                cost_micros=cost,
                price_effective_from_us=card.effective_from_us,
                currency=card.currency,
            )
        else:
            record = dataclasses.replace(
                record, cost_micros=0, price_effective_from_us=None, currency=self.config.currency
            )
        entry = None
        retention_s = self.request_log_retention_s(record.tenant_id)
        if prompt_output is not None and retention_s is not None:
            entry = RequestLogEntry(
                record.record_id, record.request_id, record.tenant_id, record.finished_at_us,
                record.finished_at_us + retention_s * 1_000_000, *prompt_output,
            )  # fmt: skip
        self.writer.submit(record, entry)
        self._queue_alerts(
            self.budgets.add(record.tenant_id, month_key(record.finished_at_us), record.cost_micros)
        )
        if self.spend_sync is not None:
            self.spend_sync.wake()
        if self.cost_meter is not None:
            self.cost_meter.observe_tokens(
                record.deployment, record.model_version, record.total_tokens, record.cost_micros
            )
        return record

    # -- admin -----------------------------------------------------------------------------

    async def add_price_card(self, card: PriceCard) -> None:
        """Store a card that takes effect now or later (never in the past: billed records
        keep the prices they were billed at)."""
        now = self._clock_us()
        if card.effective_from_us < now - 60_000_000:
            raise PriceError(
                "effective_from is in the past: records already billed keep their prices. "
                "Omit it to take effect now, or give a later time."
            )
        await self.writer.run(self.store.add_price_card, card)
        self.prices = PriceBook([*self.prices.cards(), card])

    async def put_account(self, settings: AccountSettings) -> None:
        """Create or replace a tenant's budget and request-log settings."""
        await self.writer.run(self.store.put_account, settings, self._clock_us())
        self.budgets.put_account(settings)
        self._queue_alerts(self.budgets.check_all())

    def budget_status(self, tenant_id: str) -> BudgetStatus:
        self._roll_month()
        return self.budgets.status(tenant_id)

    def budget_statuses(self) -> list[BudgetStatus]:
        self._roll_month()
        return [self.budgets.status(tenant) for tenant in self.budgets.tenants()]

    async def alerts(self, tenant_id: str | None, since_us: int) -> list[BudgetAlert]:
        return await self.writer.run(self.store.alerts, tenant_id, since_us)

    async def flush(self) -> None:
        """Write everything recorded so far (an export or a report after it sees it all)."""
        if not await self.writer.flush():
            raise LedgerUnavailableError("the ledger database is down; records are spooled")

    async def usage(self, query: UsageQuery) -> AsyncIterator[list[UsageRecord]]:
        """The records of ``query`` page by page, ordered by (finished_at, record_id), after
        everything recorded before the call was written."""
        await self.flush()
        pages = self.usage_pages_sync(query)
        while (page := await asyncio.to_thread(next, pages, None)) is not None:
            yield page

    def usage_pages_sync(self, query: UsageQuery) -> Iterator[list[UsageRecord]]:
        """The same pages, read on the calling thread (a streaming response's worker thread);
        call ``flush()`` first."""
        after: Cursor | None = None
        while True:
            page = self.store.usage_page(query, after, PAGE_SIZE)
            if page:
                yield page
            if len(page) < PAGE_SIZE:
                return
            after = Cursor(page[-1].finished_at_us, page[-1].record_id)

    async def request_log(
        self, tenant_id: str, start_us: int, end_us: int, limit: int
    ) -> list[RequestLogEntry]:
        await self.flush()
        return await asyncio.to_thread(self.store.request_log, tenant_id, start_us, end_us, limit)

    # -- the refresher ---------------------------------------------------------------------

    async def refresh(self) -> None:
        """Write what is pending, then read spend, prices, settings and fired alerts."""
        now = self._clock_us()
        self._roll_month()
        month = self.budgets.month
        period = month_of(now)  # the month of `month`, even if it turns during the flush
        generation = self.budgets.begin_refresh()
        mark = self.budgets.pending_mark()
        await self.flush()
        spend = await self.writer.run(self.store.spend_by_tenant, period.start_us, period.end_us)
        fired = await self.writer.run(self.store.alerts, None, period.start_us)
        self.budgets.complete_refresh(generation, month, spend, fired)
        if self.spend_sync is not None:
            try:
                await self.spend_sync.reconcile(month, spend, mark)
            except SpendStoreUnavailable as exc:
                self._reconcile_retry_s = next_retry_s(self._reconcile_retry_s)
                log.debug("budget counters not reconciled (again in %.1f s): %s",
                          self._reconcile_retry_s, exc)  # fmt: skip
            else:
                self._reconcile_retry_s = None
        self.budgets.set_accounts(await self.writer.run(self.store.accounts))
        self.prices = PriceBook(await self.writer.run(self.store.price_cards))
        # Levels crossed by other gateways' spend, or by a budget lowered below the spend:
        # no request of this tenant may come to trigger them here.
        self._queue_alerts(self.budgets.check_all())

    async def _run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for returns a wait that finished in
            # the same loop iteration as a cancel, and aclose() would then wait forever.
            wait_s = self.config.refresh_interval_s
            if self._reconcile_retry_s is not None:
                wait_s = min(wait_s, self._reconcile_retry_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self._announce_alerts()
                await self.refresh()
                await self._purge_request_log()
            except LedgerUnavailableError as exc:
                log.debug("billing refresh skipped: %s", exc)

    def _on_shared_spend(self, tenant_id: str | None) -> None:
        """Another gateway's spend raised this one's view: alert levels it crossed fire here
        if not elsewhere (the alert store keeps one of each)."""
        alerts = self.budgets.check_all() if tenant_id is None else self.budgets.check(tenant_id)
        self._queue_alerts(alerts)

    def _queue_alerts(self, alerts: list[BudgetAlert]) -> None:
        if alerts:
            self._unannounced.extend(alerts)
            self._wake.set()

    async def _announce_alerts(self) -> None:
        """Store each new alert; announce the ones no other gateway stored first."""
        while self._unannounced:
            alert = dataclasses.replace(self._unannounced.pop(0), fired_at_us=self._clock_us())
            storing = asyncio.ensure_future(self.writer.run(self.store.add_alert, alert))
            try:
                is_new = await asyncio.shield(storing)
            except asyncio.CancelledError:
                # Shutting down mid-insert: the row may be committed already, so only this
                # call can announce it. Finish it, announce, then stop.
                with contextlib.suppress(LedgerUnavailableError):
                    if await storing:
                        self._announce(alert)
                raise
            except LedgerUnavailableError:
                self._unannounced.insert(0, alert)
                raise
            if is_new:
                self._announce(alert)

    def _announce(self, alert: BudgetAlert) -> None:
        key = (alert.tenant_id, alert.threshold_pct)
        self.alert_stats.fired[key] = self.alert_stats.fired.get(key, 0) + 1
        log.warning(
            "budget alert: tenant %s reached %d%% of its %s budget (%s of %s %s)",
            alert.tenant_id, alert.threshold_pct, alert.month,
            _money(alert.spend_micros), _money(alert.budget_micros), self.config.currency,
        )  # fmt: skip

    async def _purge_request_log(self) -> None:
        """Delete request-log entries past their retention: at the first refresh after a start
        (entries may have expired while no gateway ran), then every ``purge_interval_s``.
        Timed on the ledger's clock, which the expiry times are on too."""
        now = self._clock_us()
        if self._next_purge_us is not None and now < self._next_purge_us:
            return
        num_deleted = await self.writer.run(self.store.purge_request_log, now)
        self._next_purge_us = now + round(self.config.purge_interval_s * 1_000_000)
        if num_deleted:
            log.info("request log: deleted %d entries past their retention", num_deleted)

    def _roll_month(self) -> None:
        month = month_key(self._clock_us())
        if month > self.budgets.month:
            self.budgets.roll_over(month)
            if self.spend_sync is not None:
                self.spend_sync.wake()  # read the new month's counters


def _money(micros: int) -> str:
    """Micro-units as a decimal string with 2 to 6 places (``12.50``, ``0.000123``)."""
    units, fraction = divmod(micros, 1_000_000)
    digits = f"{fraction:06d}".rstrip("0")
    return f"{units}.{digits.ljust(2, '0')}"

"""Keeping a gateway's ``BudgetGuard`` in step with the spend counter every gateway shares.

    record (Billing.record)   the cost is pending in the guard (counted here at once) and the
                              pusher is woken
    pusher (task)             adds everything pending to the counter in one script, then drops
                              it from pending: the reply's totals (everyone's spend) replace it
    listener (task)           other gateways' increments arrive on the channel and raise the
                              guard's totals (alerts they cross are checked here too)
    reconcile (the refresher) after its flush and ledger read: counters below the ledger's
                              figures are raised to them; a month missing from Redis is seeded
                              from the ledger (``SET`` only if missing: one gateway wins)

Invariants: spend recorded here is in the guard's figure from ``record`` on (pending until the
counter's reply includes it; a reload waits for the pusher's lock, so it never sees an increment
still pending; another gateway's total, delivered before this one's reply, can count it twice
for that round trip: refusing early, never late). The counter never starts from zero: an
increment into a missing month is refused and stays pending until the refresher seeded it from
the ledger. After a seed, spend other gateways had not yet written to the ledger (their last
flush interval, 0.2 s) is missing until the next refresh's floor: the bound right after Redis
lost its data is the one-gateway bound (one refresh), and it closes at that refresh.

Redis down: pending spend stays (counted here) and is pushed when it is back; the guard keeps
the larger of the ledger's view and the counter's last totals, so budgets degrade to the
ledger refresh's bound and never block serving, unless the policy is closed
(``Billing.check_budget`` then refuses tenants with a budget, 503, until Redis answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from billing.budgets import BudgetGuard
from billing.spend_redis import RedisSpend, SpendStoreUnavailable

log = logging.getLogger("tandem.billing")

RETRY_INITIAL_S = 0.1
RETRY_MAX_S = 5.0


def next_retry_s(last_s: float | None) -> float:
    """The wait after a failed try: ``RETRY_INITIAL_S`` after the first failure (``last_s``
    None: no wait yet), then twice the last wait, up to ``RETRY_MAX_S``."""
    return RETRY_INITIAL_S if last_s is None else min(last_s * 2, RETRY_MAX_S)


class SpendSync:
    """Owns the pusher and the listener; used on the event loop only."""

    def __init__(
        self,
        store: RedisSpend,
        guard: BudgetGuard,
        *,
        on_raised: Callable[[str | None], None],
        request_seed: Callable[[], None],
    ) -> None:
        """``on_raised(tenant)``: the guard's view of a tenant grew (None: of any); its alert
        levels want checking. ``request_seed()``: the month is missing from Redis; the owner's
        refresher should flush, read the ledger and ``reconcile``."""
        self.store = store
        self._guard = guard
        self._on_raised = on_raised
        self._request_seed = request_seed
        self._lock = asyncio.Lock()  # one push, reload or reconcile at a time
        self._wake = asyncio.Event()
        self._reload_needed = True
        self._saw_missing = False
        """The month was missing since the last reconcile: pending spend waits for it (it may
        be in a seed another gateway made from the ledger already)."""
        self._pushing_ok = True
        self._listening = False
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def up(self) -> bool:
        """Redis answered the last push and the channel is subscribed."""
        return self._pushing_ok and self._listening

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._push_loop(), name="budget-spend-pusher"),
            asyncio.create_task(self._listen_loop(), name="budget-spend-listener"),
        ]

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Push what is pending (within ``timeout_s``), stop both tasks and release Redis."""
        with contextlib.suppress(SpendStoreUnavailable, TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.push()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.store.aclose()

    def wake(self) -> None:
        """Something is pending, or the month turned: push (and read) soon."""
        self._wake.set()

    async def push(self) -> bool:
        """Add what is pending to the counter now; False when the month is not seeded yet (it
        stays pending). Raises ``SpendStoreUnavailable``."""
        async with self._lock:
            if self._reload_needed or not self._guard.has_shared:
                await self._reload()
            if self._saw_missing:
                return False
            month, mark, amounts = self._guard.pending_batch()
            if not amounts:
                return True
            totals = await self.store.add(month, amounts)
            if totals is None:
                self._missing()
                return False
            self._guard.settle_pending(month, mark)
            for tenant_id, total in totals.items():
                self._guard.shared_seen(month, tenant_id, total)
            return True

    async def reconcile(self, month: str, ledger_spend: dict[str, int], mark: int) -> None:
        """After a flush started at ``mark`` and the ledger's ``month`` spend read after it:
        raise counters below the ledger (spend a gateway recorded but could not push before it
        stopped or lost Redis; never below what is pending here, which the counter has not
        got), or seed a missing month from the ledger. Raises ``SpendStoreUnavailable``."""
        async with self._lock:
            if month != self._guard.month:
                return
            seeded = await self.store.floor(month, self._floors(ledger_spend))
            if not seeded:
                self._saw_missing = True
                if await self.store.seed(month, ledger_spend):
                    log.info("budget counters for %s seeded from the ledger", month)
            if self._saw_missing:
                # Spend pending before the flush is in the ledger's figures, and maybe in a
                # seed another gateway made from them: it is dropped, never pushed, so never
                # counted twice; a seed that lacks it is raised to the ledger's figures here.
                self._guard.settle_pending(month, mark)
                self._saw_missing = False
                await self.store.floor(month, self._floors(ledger_spend))
            await self._reload()
        self._wake.set()

    def _floors(self, ledger_spend: dict[str, int]) -> dict[str, int]:
        """The ledger's figures less what is pending here (the counter has not got it; the
        ledger may have it already)."""
        return {
            tenant_id: micros - self._guard.pending_micros(tenant_id)
            for tenant_id, micros in ledger_spend.items()
        }

    def _missing(self) -> None:
        self._saw_missing = True
        self._request_seed()

    async def _reload(self) -> None:
        month = self._guard.month
        totals = await self.store.read(month)
        if totals is None:
            self._missing()
            return
        self._guard.shared_loaded(month, totals)
        self._reload_needed = False
        self._on_raised(None)

    async def _push_loop(self) -> None:
        retry_s = RETRY_INITIAL_S
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.push()
            except SpendStoreUnavailable as exc:
                if self._pushing_ok:
                    log.error("budget spend store unavailable (spend kept here): %s", exc)
                self._pushing_ok = False
                await asyncio.sleep(retry_s)
                retry_s = next_retry_s(retry_s)
                self._wake.set()
                continue
            if not self._pushing_ok:
                log.info("budget spend store is back")
            self._pushing_ok = True
            retry_s = RETRY_INITIAL_S

    async def _listen_loop(self) -> None:
        retry_s = RETRY_INITIAL_S
        while True:
            try:
                async for event in self.store.events():
                    if event is None:  # (re)subscribed: what was missed is read whole
                        self._listening = True
                        retry_s = RETRY_INITIAL_S
                        self._reload_needed = True
                        self._wake.set()
                    elif event.source == self.store.source:
                        continue  # this gateway's own: its reply settles it
                    elif event.seeded:
                        self._reload_needed = True
                        self._wake.set()
                    elif event.tenant_id is not None and self._guard.shared_seen(
                        event.month, event.tenant_id, event.total_micros
                    ):
                        self._on_raised(event.tenant_id)
            except SpendStoreUnavailable as exc:
                if self._listening:
                    log.error("budget spend channel lost: %s", exc)
            self._listening = False
            await asyncio.sleep(retry_s)
            retry_s = next_retry_s(retry_s)

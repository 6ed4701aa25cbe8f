"""Monthly budgets: each tenant's spend this UTC month against its limit, and alert levels.

One gateway: the spend it sees is what the ledger database held at the last refresh plus what
this gateway recorded since. A refresh is numbered: the writer flushes everything recorded
before it, then the database is read, so those records are counted once (in the database
figure) and only later ones stay local.

Several gateways sharing Redis (``billing/spend_sync.py``, ``billing/spend_redis.py``): a
per-month counter every gateway adds its spend to and follows the others' through. A gateway's
figure is the larger of the ledger view above and the counter's total plus its own spend the
counter has not taken yet (pending): its own spend counts from ``add`` on, the others' from
when Redis delivers their increment (a round trip, not a refresh). The ledger stays the
source of truth for invoices; the counter is raised to the ledger's figures at each refresh
and seeded from it when Redis lost a month. What remains: requests already running when the
budget was reached (the check is at admission, the cost known at the end), and for the one
Redis delivery another gateway's just-recorded spend is not seen yet.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from billing.store import AccountSettings, BudgetAlert


@dataclass(frozen=True, slots=True)
class BudgetStatus:
    """A tenant's standing this month."""

    tenant_id: str
    month: str
    budget_micros: int | None
    spend_micros: int

    @property
    def exhausted(self) -> bool:
        return self.budget_micros is not None and self.spend_micros >= self.budget_micros

    @property
    def used_ratio(self) -> float | None:
        """Spend over budget, for metrics and display only (money stays integer)."""
        if not self.budget_micros:
            return None
        return self.spend_micros / self.budget_micros


class BudgetGuard:
    """In-memory view of every tenant's monthly spend; mutated on the event loop only."""

    def __init__(self, month: str, *, shared: bool = False) -> None:
        """``shared``: a shared counter (``billing/spend_sync.py``) exists; what this gateway
        records is also kept as pending until the counter took it."""
        self.month = month
        self._accounts: dict[str, AccountSettings] = {}
        self._stored_spend: dict[str, int] = {}
        self._local: dict[tuple[int, str], dict[str, int]] = {}
        """(refresh generation, month) -> tenant -> micros recorded by this gateway."""
        self._generation = 0
        self._fired: set[tuple[str, str, int]] = set()
        """(tenant, month, threshold) alerts already fired (here or by another gateway)."""
        self._is_shared = shared
        self._shared: dict[str, int] | None = None
        """This month's totals as the shared counter last told them; None: not read yet."""
        self._seen_unloaded: dict[str, int] = {}
        """Totals the channel delivered before the month's first read came back."""
        self._pending: list[tuple[int, str, int]] = []
        """(sequence, tenant, micros) recorded this month, not yet taken by the counter."""
        self._pending_by_tenant: dict[str, int] = {}
        self._sequence = 0

    def set_accounts(self, accounts: Iterable[AccountSettings]) -> None:
        """Replace every tenant's settings (from the database or an admin change)."""
        self._accounts = {account.tenant_id: account for account in accounts}

    def put_account(self, account: AccountSettings) -> None:
        self._accounts[account.tenant_id] = account

    def account(self, tenant_id: str) -> AccountSettings:
        """A tenant's settings; the defaults (no budget, no request log) if it has none."""
        return self._accounts.get(tenant_id) or AccountSettings(tenant_id)

    def add(self, tenant_id: str, month: str, cost_micros: int) -> list[BudgetAlert]:
        """Count a record's cost; returns the alert levels it crossed first (to be stored and
        announced by the caller). ``fired_at_us`` is left 0 for the caller to set."""
        if month > self.month:
            self.roll_over(month)
        local = self._local.setdefault((self._generation, month), {})
        local[tenant_id] = local.get(tenant_id, 0) + cost_micros
        if month != self.month:
            return []  # a straggler from last month: counted, but alerts are this month's
        if self._is_shared and cost_micros:
            self._pending.append((self._sequence, tenant_id, cost_micros))
            self._sequence += 1
            self._pending_by_tenant[tenant_id] = (
                self._pending_by_tenant.get(tenant_id, 0) + cost_micros
            )
        return self._crossed(tenant_id)

    def check(self, tenant_id: str) -> list[BudgetAlert]:
        """Levels of one tenant crossed that have not fired (after the shared counter told of
        another gateway's spend)."""
        return self._crossed(tenant_id)

    def check_all(self) -> list[BudgetAlert]:
        """Levels crossed that have not fired, for every tenant with a budget (after a refresh
        brought other gateways' spend, or a budget was lowered)."""
        return [
            alert
            for tenant_id, account in sorted(self._accounts.items())
            if account.monthly_budget_micros
            for alert in self._crossed(tenant_id)
        ]

    def spend(self, tenant_id: str) -> int:
        """This month's spend of ``tenant_id`` as this gateway knows it: the ledger's figure
        plus what was recorded here since; with a shared counter, the larger of that and the
        counter's total plus what here it has not taken yet (both miss no spend of this
        gateway; the counter also has every other gateway's)."""
        total = self._stored_spend.get(tenant_id, 0)
        for (_, month), local in self._local.items():
            if month == self.month:
                total += local.get(tenant_id, 0)
        if self._shared is not None:
            shared = self._shared.get(tenant_id, 0) + self._pending_by_tenant.get(tenant_id, 0)
            total = max(total, shared)
        return total

    def status(self, tenant_id: str) -> BudgetStatus:
        return BudgetStatus(
            tenant_id,
            self.month,
            self.account(tenant_id).monthly_budget_micros,
            self.spend(tenant_id),
        )

    def tenants(self) -> list[str]:
        """Tenants with settings or spend this month, sorted."""
        known = set(self._accounts) | set(self._stored_spend) | set(self._shared or {})
        for (_, month), local in self._local.items():
            if month == self.month:
                known |= set(local)
        return sorted(known)

    def begin_refresh(self) -> int:
        """Start a refresh: what is recorded from now on is newer than its database read."""
        generation = self._generation
        self._generation += 1
        return generation

    def complete_refresh(
        self,
        generation: int,
        month: str,
        stored_spend: dict[str, int],
        fired: Iterable[BudgetAlert],
    ) -> None:
        """The database's figures for ``month``, read after every record of ``generation``
        (and earlier) was written: those leave the local counts."""
        if month != self.month:
            return  # the month turned during the refresh; the next one reads the new month
        self._stored_spend = dict(stored_spend)
        for key in [key for key in self._local if key[0] <= generation]:
            del self._local[key]
        self._fired |= {(a.tenant_id, a.month, a.threshold_pct) for a in fired}

    def roll_over(self, month: str) -> None:
        """A new month: spend starts from zero (last month's stragglers stay out of it)."""
        self.month = month
        self._stored_spend = {}
        self._fired = {key for key in self._fired if key[1] == month}
        self._shared = None
        self._seen_unloaded = {}
        self._pending = []
        self._pending_by_tenant = {}

    # -- the shared counter (several gateways; ``billing/spend_sync.py`` calls these) -------

    @property
    def has_shared(self) -> bool:
        """The shared counter's totals for this month were read."""
        return self._shared is not None

    def pending_mark(self) -> int:
        """A mark: pending spend recorded before it is older than a flush started now."""
        return self._sequence

    def pending_batch(self) -> tuple[str, int, dict[str, int]]:
        """This month, a mark after the pending spend, and that spend by tenant (to add to
        the counter; ``settle_pending`` with the mark once it took it)."""
        return self.month, self._sequence, dict(self._pending_by_tenant)

    def pending_micros(self, tenant_id: str) -> int:
        """Spend of ``tenant_id`` recorded here that the counter has not taken yet."""
        return self._pending_by_tenant.get(tenant_id, 0)

    def settle_pending(self, month: str, mark: int) -> None:
        """Pending spend recorded before ``mark`` left: the counter took it (or was seeded from
        a ledger that has it)."""
        if month != self.month:
            return
        kept = [item for item in self._pending if item[0] >= mark]
        self._pending = kept
        self._pending_by_tenant = {}
        for _, tenant_id, micros in kept:
            self._pending_by_tenant[tenant_id] = self._pending_by_tenant.get(tenant_id, 0) + micros

    def shared_loaded(self, month: str, totals: dict[str, int]) -> None:
        """The counter's whole month, as just read, merged by the larger total per tenant with
        what this gateway saw before. A read and a message travel apart (the read on one
        connection, the channel on another): an increment Redis ran after the read can be
        delivered before the read's reply, and replacing the view with the reply would lose it
        until the next refresh. Keeping the larger total refuses early, never late."""
        if month != self.month:
            return
        merged = dict(totals)
        for seen in (self._shared or {}, self._seen_unloaded):
            for tenant_id, total in seen.items():
                if total > merged.get(tenant_id, 0):
                    merged[tenant_id] = total
        self._shared = merged
        self._seen_unloaded = {}

    def shared_seen(self, month: str, tenant_id: str, total: int) -> bool:
        """A total the counter reported (a reply or a message); totals only grow between reads,
        so an older one arriving late changes nothing. True if it raised this gateway's view;
        before the month's first read came back, it is kept for that read (False)."""
        if month != self.month:
            return False
        seen = self._seen_unloaded if self._shared is None else self._shared
        if total <= seen.get(tenant_id, 0):
            return False
        seen[tenant_id] = total
        return self._shared is not None

    def _crossed(self, tenant_id: str) -> list[BudgetAlert]:
        account = self.account(tenant_id)
        budget = account.monthly_budget_micros
        if not budget:
            return []
        spend = self.spend(tenant_id)
        alerts: list[BudgetAlert] = []
        for threshold in sorted(account.alert_thresholds_pct):
            key = (tenant_id, self.month, threshold)
            # Integer comparison: spend/budget >= threshold/100 without rounding.
            if key not in self._fired and spend * 100 >= budget * threshold:
                self._fired.add(key)
                alerts.append(BudgetAlert(tenant_id, self.month, threshold, spend, budget, 0))
        return alerts

"""Monthly budgets: each tenant's spend this UTC month against its limit, and alert levels.

The spend a gateway sees is what the ledger database held at the last refresh plus what this
gateway recorded since. A refresh is numbered: the writer flushes everything recorded before
it, then the database is read, so those records are counted once (in the database figure)
and only later ones stay local. Other gateways' spend arrives with the next refresh: the
budget can be overshot by what they record in one refresh interval, and by requests already
running when it was reached (the check is at admission, the cost known at the end).
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

    def __init__(self, month: str) -> None:
        self.month = month
        self._accounts: dict[str, AccountSettings] = {}
        self._stored_spend: dict[str, int] = {}
        self._local: dict[tuple[int, str], dict[str, int]] = {}
        """(refresh generation, month) -> tenant -> micros recorded by this gateway."""
        self._generation = 0
        self._fired: set[tuple[str, str, int]] = set()
        """(tenant, month, threshold) alerts already fired (here or by another gateway)."""

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
        """This month's spend of ``tenant_id`` as this gateway knows it."""
        total = self._stored_spend.get(tenant_id, 0)
        for (_, month), local in self._local.items():
            if month == self.month:
                total += local.get(tenant_id, 0)
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
        known = set(self._accounts) | set(self._stored_spend)
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

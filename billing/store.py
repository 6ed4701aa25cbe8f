"""What the ledger database holds, and the errors its stores raise.

LedgerStore (sync; called from worker threads, one connection per thread)
  ├─ SqliteLedgerStore   (billing/sql_store.py) embedded default, WAL, one file
  └─ PostgresLedgerStore (billing/sql_store.py) when TANDEM_BILLING_DATABASE_URL is set

LedgerError
  └─ LedgerUnavailableError  the database cannot be reached now: the writer spools and
                             retries; a read answers 503 ``ledger_unavailable``
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from billing.prices import PriceCard
from billing.records import UsageRecord

DEFAULT_ALERT_THRESHOLDS_PCT: tuple[int, ...] = (50, 80, 100)


class LedgerError(Exception):
    """The ledger database failed."""


class LedgerUnavailableError(LedgerError):
    """The database cannot be reached (down, locked past the timeout, disk full)."""


@dataclass(frozen=True, slots=True)
class AccountSettings:
    """A tenant's billing settings (an absent row means: no budget, no request log)."""

    tenant_id: str
    monthly_budget_micros: int | None = None
    """Spend limit per UTC calendar month; None: unlimited."""
    alert_thresholds_pct: tuple[int, ...] = DEFAULT_ALERT_THRESHOLDS_PCT
    """Percentages of the budget at which an alert is emitted (once per month each)."""
    request_log: bool = False
    """Keep this tenant's prompts and outputs (PII scrubbed)."""
    request_log_retention_s: int = 7 * 86_400
    """How long kept prompts and outputs live before they are deleted."""


@dataclass(frozen=True, slots=True)
class BudgetAlert:
    """A threshold crossed by a tenant's monthly spend (stored once per tenant, month, level)."""

    tenant_id: str
    month: str
    """``YYYY-MM`` (UTC)."""
    threshold_pct: int
    spend_micros: int
    budget_micros: int
    fired_at_us: int


@dataclass(frozen=True, slots=True)
class RequestLogEntry:
    """One request's prompt and output, kept for a tenant that opted in (PII scrubbed)."""

    record_id: str
    request_id: str
    tenant_id: str
    created_at_us: int
    expires_at_us: int
    prompt: str
    """The request's messages or prompt as JSON text, scrubbed."""
    output: str
    """The generated text, scrubbed."""


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """Records that ended in ``[start_us, end_us)``, optionally of one tenant."""

    start_us: int
    end_us: int
    tenant_id: str | None = None


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where the previous page of a usage scan ended (records are ordered by these two)."""

    finished_at_us: int
    record_id: str


@dataclass(slots=True)
class InsertResult:
    """What one batch insert did."""

    num_inserted: int = 0
    num_duplicates: int = 0
    """Records already in the ledger (a replayed spool, a retried batch): ignored."""
    ids: list[str] = field(default_factory=list)


class LedgerStore(Protocol):
    """The ledger database. Every method may raise ``LedgerUnavailableError``."""

    def migrate(self) -> list[int]:
        """Apply pending schema migrations; returns the versions applied now."""
        ...

    def insert_usage(self, records: Sequence[UsageRecord]) -> InsertResult:
        """Insert in one transaction; a record whose ``record_id`` exists is ignored."""
        ...

    def usage_page(self, query: UsageQuery, after: Cursor | None, limit: int) -> list[UsageRecord]:
        """Up to ``limit`` records after ``after``, ordered by (finished_at_us, record_id)."""
        ...

    def count_usage(self, query: UsageQuery) -> tuple[int, int]:
        """(number of records, total cost micros) of ``query``."""
        ...

    def spend_by_tenant(self, start_us: int, end_us: int) -> dict[str, int]:
        """Cost micros per tenant of records that ended in ``[start_us, end_us)``."""
        ...

    def add_price_card(self, card: PriceCard) -> None:
        """Store a new card; raises ``PriceConflictError`` if one has the same version and date."""
        ...

    def price_cards(self) -> list[PriceCard]:
        """Every card."""
        ...

    def put_account(self, settings: AccountSettings, updated_at_us: int) -> None:
        """Create or replace a tenant's billing settings."""
        ...

    def accounts(self) -> list[AccountSettings]:
        """Every tenant's billing settings."""
        ...

    def add_alert(self, alert: BudgetAlert) -> bool:
        """Store an alert; False if that tenant, month and threshold already fired."""
        ...

    def alerts(self, tenant_id: str | None, since_us: int) -> list[BudgetAlert]:
        """Alerts fired since ``since_us``, oldest first."""
        ...

    def insert_request_log(self, entries: Sequence[RequestLogEntry]) -> None:
        """Keep these entries (an existing record id is ignored)."""
        ...

    def request_log(
        self, tenant_id: str, start_us: int, end_us: int, limit: int
    ) -> list[RequestLogEntry]:
        """A tenant's kept entries created in ``[start_us, end_us)``, oldest first."""
        ...

    def purge_request_log(self, now_us: int) -> int:
        """Delete entries past their expiry; returns how many."""
        ...

    def close(self) -> None:
        """Close every connection this store opened."""
        ...


class PriceConflictError(LedgerError):
    """A card for that model version and effective date exists already."""

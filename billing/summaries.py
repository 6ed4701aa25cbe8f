"""Billing periods and what finance reads off the ledger: daily summaries and invoices.

Everything here is a pure function of ``UsageRecord``s. Sums are of integer micro-units and
token counts, so they are exact and independent of the order records arrive in: the sum of the
daily summaries' ``cost_micros`` equals the sum over the records equals the invoice totals. A
record belongs to the UTC day and the period of its ``finished_at_us`` (when it is billed).

A period is half-open, ``[start_us, end_us)``: consecutive periods (months) share a boundary
and no record falls in two of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from billing.records import RequestStatus, UsageRecord, from_unix_us, to_unix_us

_US_PER_DAY = 86_400_000_000

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
# RFC 3339 with a mandatory offset. At most 6 fractional digits: the ledger counts microseconds,
# and silently truncating nanoseconds would move a boundary.
_TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,6})?([Zz]|[+-]\d{2}:\d{2})")


class PeriodError(ValueError):
    """A period that cannot be accepted; the message names the parameter and shows an example."""

    def __init__(self, message: str, param: str = "to") -> None:
        super().__init__(message)
        self.param = param
        """The parameter to fix (``from``, ``to``, or the caller's name for an instant)."""


@dataclass(frozen=True, slots=True)
class Period:
    """``[start_us, end_us)`` in Unix microseconds (UTC): start inclusive, end exclusive."""

    start_us: int
    end_us: int

    def __post_init__(self) -> None:
        if self.end_us <= self.start_us:
            raise PeriodError("to must be after from (the period's end is exclusive)")

    def contains(self, at_us: int) -> bool:
        """Whether an instant (a record's ``finished_at_us``) falls in the period."""
        return self.start_us <= at_us < self.end_us


def parse_period(from_text: str, to_text: str) -> Period:
    """The period ``[from, to)`` from two dates (``2026-11-01``, midnight UTC) or RFC 3339
    timestamps with an offset (``2026-11-01T00:00:00Z``). ``to`` is exclusive: November is
    ``from=2026-11-01, to=2026-12-01``."""
    start_us = parse_instant(from_text, "from")
    end_us = parse_instant(to_text, "to")
    if end_us <= start_us:
        raise PeriodError(
            f"to must be after from (to is exclusive; got from={from_text!r}, to={to_text!r}); "
            "e.g. from=2026-11-01 to=2026-12-01 for November"
        )
    return Period(start_us, end_us)


def parse_instant(text: str, param: str) -> int:
    """Unix µs of a date (midnight UTC) or an RFC 3339 timestamp with an offset; the error
    names ``param``."""
    stripped = text.strip()
    try:
        if _DATE.fullmatch(stripped):
            day = datetime.strptime(stripped, "%Y-%m-%d").replace(tzinfo=UTC)
            return to_unix_us(day)
        if _TIMESTAMP.fullmatch(stripped):
            # Python 3.11's fromisoformat takes "Z" but not a lower-case "t"/"z".
            return to_unix_us(datetime.fromisoformat(stripped.upper()))
    except ValueError:
        pass  # a well-shaped but impossible value (2026-02-30, 25:00): same message as junk
    raise PeriodError(
        f"{param} must be a date such as 2026-11-01 (midnight UTC) or an RFC 3339 timestamp "
        f"with an offset such as 2026-11-01T00:00:00Z; got {text!r}",
        param,
    )


def month_of(at_us: int) -> Period:
    """The UTC calendar month containing ``at_us`` (budgets reset on these boundaries)."""
    moment = from_unix_us(at_us)
    start = datetime(moment.year, moment.month, 1, tzinfo=UTC)
    if moment.month == 12:
        end = datetime(moment.year + 1, 1, 1, tzinfo=UTC)
    else:
        end = datetime(moment.year, moment.month + 1, 1, tzinfo=UTC)
    return Period(to_unix_us(start), to_unix_us(end))


def day_of(at_us: int) -> str:
    """The UTC day (``YYYY-MM-DD``) of an instant: the day a record is summarised under."""
    # Floor division keeps instants before the epoch on the right day.
    day = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(days=at_us // _US_PER_DAY)
    return day.strftime("%Y-%m-%d")


def day_period(day: str) -> Period:
    """``[midnight, next midnight)`` UTC of a ``YYYY-MM-DD`` day (as ``day_of`` gives it)."""
    start_us = to_unix_us(datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=UTC))
    return Period(start_us, start_us + _US_PER_DAY)


@dataclass(frozen=True, slots=True)
class DailySummary:
    """One tenant's use of one deployment of one model version on one UTC day, in one currency."""

    day: str
    """``YYYY-MM-DD`` (UTC) of the records' ``finished_at_us``."""
    tenant_id: str
    model: str
    model_version: str
    deployment: str
    num_requests: int
    num_completed: int
    num_failed: int
    num_aborted: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_micros: int
    currency: str


@dataclass(slots=True)
class _Counts:
    """A mutable running total behind one summary or invoice line."""

    num_requests: int = 0
    num_completed: int = 0
    num_failed: int = 0
    num_aborted: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost_micros: int = 0

    def add(self, record: UsageRecord) -> None:
        self.num_requests += 1
        if record.status is RequestStatus.COMPLETED:
            self.num_completed += 1
        elif record.status is RequestStatus.FAILED:
            self.num_failed += 1
        elif record.status is RequestStatus.ABORTED:
            self.num_aborted += 1
        self.prompt_tokens += record.prompt_tokens
        self.completion_tokens += record.completion_tokens
        self.cached_tokens += record.cached_tokens
        self.cost_micros += record.cost_micros


def daily_summaries(records: Iterable[UsageRecord]) -> list[DailySummary]:
    """Per (day, tenant, model, model version, deployment, currency) totals, sorted by that key.

    Every record given is counted (filter by tenant or period before calling)."""
    totals: dict[tuple[str, str, str, str, str, str], _Counts] = {}
    for record in records:
        key = (
            day_of(record.finished_at_us),
            record.tenant_id,
            record.model,
            record.model_version,
            record.deployment,
            record.currency,
        )
        totals.setdefault(key, _Counts()).add(record)
    summaries = []
    for key in sorted(totals):
        day, tenant_id, model, model_version, deployment, currency = key
        counts = totals[key]
        summaries.append(
            DailySummary(
                day=day,
                tenant_id=tenant_id,
                model=model,
                model_version=model_version,
                deployment=deployment,
                num_requests=counts.num_requests,
                num_completed=counts.num_completed,
                num_failed=counts.num_failed,
                num_aborted=counts.num_aborted,
                prompt_tokens=counts.prompt_tokens,
                completion_tokens=counts.completion_tokens,
                cached_tokens=counts.cached_tokens,
                cost_micros=counts.cost_micros,
                currency=currency,
            )
        )
    return summaries


@dataclass(frozen=True, slots=True)
class InvoiceLine:
    """What one model version cost under one price card (or unpriced) within an invoice."""

    model_version: str
    price_effective_from_us: int | None
    """The card that priced these requests; None: no card was in effect (amount 0)."""
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    amount_micros: int


@dataclass(frozen=True, slots=True)
class Invoice:
    """One tenant's charges for a period in one currency."""

    tenant_id: str
    period: Period
    currency: str
    lines: tuple[InvoiceLine, ...]
    """By model version, then price card (unpriced first)."""
    total_micros: int
    """The sum of the lines' ``amount_micros`` (and of the records' ``cost_micros``)."""
    num_requests: int
    unpriced_tokens: int
    """Prompt plus completion tokens of requests no price card covered (billed 0)."""


class InvoiceError(ValueError):
    """An invoice that cannot be made as asked (several currencies for ``invoice``)."""


_LineKey = tuple[str, str, str, int | None]  # tenant, currency, model version, card


def invoices(
    records: Iterable[UsageRecord], tenant_id: str | None, period: Period
) -> list[Invoice]:
    """The invoices of ``tenant_id`` (every tenant when None) for ``period``: one per tenant
    and currency that has records in the period, sorted by (tenant, currency).

    Records of other tenants or outside the period are left out. A tenant's records can carry
    several currencies (each price card has its own), and records are immutable, so refusing
    would make such a period impossible to bill: one invoice per currency instead, never a sum
    of different currencies."""
    lines: dict[_LineKey, _Counts] = {}
    for record in records:
        if tenant_id is not None and record.tenant_id != tenant_id:
            continue
        if not period.contains(record.finished_at_us):
            continue
        key = (
            record.tenant_id,
            record.currency,
            record.model_version,
            record.price_effective_from_us,
        )
        lines.setdefault(key, _Counts()).add(record)
    grouped: dict[tuple[str, str], list[InvoiceLine]] = {}
    # None (unpriced) sorts before every card; cards by effective date.
    for key in sorted(lines, key=lambda k: (k[0], k[1], k[2], k[3] is not None, k[3] or 0)):
        tenant, currency, version, card = key
        counts = lines[key]
        line = InvoiceLine(
            model_version=version,
            price_effective_from_us=card,
            num_requests=counts.num_requests,
            prompt_tokens=counts.prompt_tokens,
            cached_tokens=counts.cached_tokens,
            completion_tokens=counts.completion_tokens,
            amount_micros=counts.cost_micros,
        )
        grouped.setdefault((tenant, currency), []).append(line)
    return [
        Invoice(
            tenant_id=tenant,
            period=period,
            currency=currency,
            lines=tuple(invoice_lines),
            total_micros=sum(line.amount_micros for line in invoice_lines),
            num_requests=sum(line.num_requests for line in invoice_lines),
            unpriced_tokens=sum(
                line.prompt_tokens + line.completion_tokens
                for line in invoice_lines
                if line.price_effective_from_us is None
            ),
        )
        for (tenant, currency), invoice_lines in grouped.items()
    ]


def invoice(
    records: Iterable[UsageRecord], tenant_id: str, period: Period, *, currency: str = "USD"
) -> Invoice:
    """The single invoice of ``tenant_id`` for ``period``; an empty one in ``currency`` when it
    has no records. Raises ``InvoiceError`` when its records carry several currencies (use
    ``invoices``)."""
    found = invoices(records, tenant_id, period)
    if not found:
        return Invoice(tenant_id, period, currency, (), 0, 0, 0)
    if len(found) > 1:
        currencies = ", ".join(item.currency for item in found)
        raise InvoiceError(
            f"tenant {tenant_id!r} has records in several currencies ({currencies}) in this "
            "period; use invoices() for one invoice per currency"
        )
    return found[0]

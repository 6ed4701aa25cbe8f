"""Periods (parsing, errors, month boundaries), daily summaries and invoices: exact totals,
sorting, independence from input order, currencies kept apart."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from billing.records import RequestStatus, UsageRecord, to_unix_us
from billing.summaries import (
    DailySummary,
    InvoiceError,
    InvoiceLine,
    Period,
    PeriodError,
    daily_summaries,
    day_of,
    day_period,
    invoice,
    invoices,
    month_of,
    parse_period,
)
from tests.billing.records_factory import DAY_US, NOVEMBER_US, T0, make_record, make_records


def us(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, micro: int = 0
) -> int:
    return to_unix_us(datetime(year, month, day, hour, minute, second, micro, tzinfo=UTC))


# --- periods ---------------------------------------------------------------------------------


def test_dates_are_midnight_utc_and_to_is_exclusive() -> None:
    period = parse_period("2026-11-01", "2026-12-01")
    assert period == Period(us(2026, 11, 1), us(2026, 12, 1))
    assert period.contains(us(2026, 11, 1))
    assert period.contains(us(2026, 12, 1) - 1)
    assert not period.contains(us(2026, 12, 1))
    assert not period.contains(us(2026, 11, 1) - 1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-01T00:00:00Z", us(2026, 11, 1)),
        ("2026-11-01T10:30:00.000123Z", us(2026, 11, 1, 10, 30, 0, 123)),
        ("2026-11-01T10:30:00.5Z", us(2026, 11, 1, 10, 30, 0, 500_000)),
        ("2026-11-01T12:00:00+02:00", us(2026, 11, 1, 10)),
        ("2026-11-01T00:00:00-05:00", us(2026, 11, 1, 5)),
        ("2026-11-01t00:00:00z", us(2026, 11, 1)),
        ("  2026-11-01  ", us(2026, 11, 1)),
    ],
)
def test_rfc3339_timestamps_with_an_offset(text: str, expected: int) -> None:
    assert parse_period(text, "2030-01-01").start_us == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "yesterday",
        "2026/11/01",
        "01-11-2026",
        "20261101",
        "2026-11-01T00:00:00",  # no offset: ambiguous, refused
        "2026-11-01 00:00:00Z",
        "2026-11-01T00:00Z",
        "2026-11-01T00:00:00.123456789Z",  # finer than the ledger's microseconds
        "2026-02-30",
        "2026-11-01T25:00:00Z",
        "2026-11-01T00:00:00+2:00",
    ],
)
@pytest.mark.parametrize("param", ["from", "to"])
def test_bad_values_name_the_parameter_and_show_an_example(text: str, param: str) -> None:
    from_text, to_text = (text, "2030-01-01") if param == "from" else ("2020-01-01", text)
    with pytest.raises(PeriodError) as caught:
        parse_period(from_text, to_text)
    message = str(caught.value)
    assert message.startswith(f"{param} must be")
    assert "2026-11-01" in message
    assert "2026-11-01T00:00:00Z" in message
    assert repr(text) in message
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("from_text", "to_text"),
    [
        ("2026-11-01", "2026-11-01"),
        ("2026-12-01", "2026-11-01"),
        ("2026-11-01T00:00:00Z", "2026-11-01T01:00:00+01:00"),  # the same instant
    ],
)
def test_to_must_be_after_from(from_text: str, to_text: str) -> None:
    with pytest.raises(PeriodError, match="to must be after from"):
        parse_period(from_text, to_text)


def test_a_period_cannot_be_empty_or_reversed() -> None:
    with pytest.raises(PeriodError):
        Period(5, 5)
    with pytest.raises(PeriodError):
        Period(6, 5)


@pytest.mark.parametrize(
    ("at", "start", "end"),
    [
        (us(2026, 11, 15, 12), us(2026, 11, 1), us(2026, 12, 1)),
        (us(2026, 11, 1), us(2026, 11, 1), us(2026, 12, 1)),  # the first instant is in it
        (us(2026, 11, 1) - 1, us(2026, 10, 1), us(2026, 11, 1)),  # the last of October
        (us(2026, 12, 31, 23, 59, 59, 999_999), us(2026, 12, 1), us(2027, 1, 1)),
        (us(2027, 1, 1), us(2027, 1, 1), us(2027, 2, 1)),
        (us(2028, 2, 29, 23), us(2028, 2, 1), us(2028, 3, 1)),  # leap year
        (-1, us(1969, 12, 1), us(1970, 1, 1)),
    ],
)
def test_month_of(at: int, start: int, end: int) -> None:
    assert month_of(at) == Period(start, end)


def test_consecutive_months_tile_time() -> None:
    month = month_of(us(2026, 1, 1))
    for _ in range(24):
        following = month_of(month.end_us)
        assert following.start_us == month.end_us
        month = following
    assert month == Period(us(2028, 1, 1), us(2028, 2, 1))


def test_day_of_and_day_period() -> None:
    assert day_of(NOVEMBER_US) == "2026-11-01"
    assert day_of(NOVEMBER_US - 1) == "2026-10-31"
    assert day_of(-1) == "1969-12-31"
    assert day_period("2026-11-01") == Period(NOVEMBER_US, NOVEMBER_US + DAY_US)


# --- daily summaries -------------------------------------------------------------------------


def test_daily_summary_of_a_few_records() -> None:
    records = [
        make_record(record_id="a", finished_at_us=NOVEMBER_US - 1, cost_micros=100),
        make_record(
            record_id="b",
            finished_at_us=NOVEMBER_US,
            status=RequestStatus.FAILED,
            prompt_tokens=10,
            completion_tokens=0,
            cached_tokens=0,
            cost_micros=3,
        ),
        make_record(
            record_id="c",
            finished_at_us=NOVEMBER_US + DAY_US - 1,
            status=RequestStatus.ABORTED,
            prompt_tokens=20,
            completion_tokens=5,
            cached_tokens=20,
            cost_micros=7,
        ),
        make_record(record_id="d", finished_at_us=NOVEMBER_US, deployment="llama-canary"),
    ]
    common = {"tenant_id": "acme", "model": "llama-3.1-8b", "model_version": "llama-3.1-8b@a1"}
    assert daily_summaries(records) == [
        DailySummary(
            day="2026-10-31",
            deployment="llama-stable",
            num_requests=1,
            num_completed=1,
            num_failed=0,
            num_aborted=0,
            prompt_tokens=1000,
            completion_tokens=200,
            cached_tokens=400,
            cost_micros=100,
            currency="USD",
            **common,
        ),
        DailySummary(
            day="2026-11-01",
            deployment="llama-canary",
            num_requests=1,
            num_completed=1,
            num_failed=0,
            num_aborted=0,
            prompt_tokens=1000,
            completion_tokens=200,
            cached_tokens=400,
            cost_micros=240,
            currency="USD",
            **common,
        ),
        DailySummary(
            day="2026-11-01",
            deployment="llama-stable",
            num_requests=2,
            num_completed=0,
            num_failed=1,
            num_aborted=1,
            prompt_tokens=30,
            completion_tokens=5,
            cached_tokens=20,
            cost_micros=10,
            currency="USD",
            **common,
        ),
    ]


def test_daily_totals_equal_the_records_exactly() -> None:
    records = make_records()
    summaries = daily_summaries(records)
    assert sum(s.cost_micros for s in summaries) == sum(r.cost_micros for r in records)
    assert sum(s.num_requests for s in summaries) == len(records)
    assert sum(s.prompt_tokens for s in summaries) == sum(r.prompt_tokens for r in records)
    assert sum(s.completion_tokens for s in summaries) == sum(r.completion_tokens for r in records)
    assert sum(s.cached_tokens for s in summaries) == sum(r.cached_tokens for r in records)
    for summary in summaries:
        assert (
            summary.num_completed + summary.num_failed + summary.num_aborted == summary.num_requests
        )
    # Per currency too: amounts in different currencies are never added together.
    for currency in ("USD", "EUR"):
        assert sum(s.cost_micros for s in summaries if s.currency == currency) == sum(
            r.cost_micros for r in records if r.currency == currency
        )
    assert {s.day for s in summaries} == {"2026-10-30", "2026-10-31", "2026-11-01", "2026-11-02"}


def test_daily_summaries_are_sorted_by_their_key_and_ignore_input_order() -> None:
    records = make_records()
    summaries = daily_summaries(records)
    keys = [
        (s.day, s.tenant_id, s.model, s.model_version, s.deployment, s.currency) for s in summaries
    ]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)
    shuffled = records[:]
    random.Random(3).shuffle(shuffled)
    assert daily_summaries(iter(shuffled)) == summaries
    assert daily_summaries([]) == []


# --- invoices --------------------------------------------------------------------------------


def _in(records: list[UsageRecord], tenant_id: str, period: Period) -> list[UsageRecord]:
    return [r for r in records if r.tenant_id == tenant_id and period.contains(r.finished_at_us)]


@pytest.mark.parametrize("tenant_id", ["acme", "globex", "initech", "anonymous"])
def test_invoices_total_the_records_per_currency(tenant_id: str) -> None:
    records = make_records()
    period = Period(T0, T0 + 4 * DAY_US)
    found = invoices(records, tenant_id, period)
    mine = _in(records, tenant_id, period)
    assert [bill.currency for bill in found] == ["EUR", "USD"]  # this data has both
    for bill in found:
        in_currency = [r for r in mine if r.currency == bill.currency]
        assert bill.tenant_id == tenant_id
        assert bill.period == period
        assert bill.total_micros == sum(r.cost_micros for r in in_currency)
        assert bill.total_micros == sum(line.amount_micros for line in bill.lines)
        assert bill.num_requests == len(in_currency)
        assert bill.unpriced_tokens == sum(
            r.total_tokens for r in in_currency if r.price_effective_from_us is None
        )
        assert sum(line.cached_tokens for line in bill.lines) == sum(
            r.cached_tokens for r in in_currency
        )
    assert sum(bill.num_requests for bill in found) == len(mine)


def test_invoice_lines_are_per_model_version_and_card_with_unpriced_first() -> None:
    records = make_records()
    usd = invoices(records, "acme", Period(T0, T0 + 4 * DAY_US))[1]
    keys = [(line.model_version, line.price_effective_from_us) for line in usd.lines]
    assert len(set(keys)) == len(keys)
    llama_cards = [card for version, card in keys if version == "llama-3.1-8b@a1"]
    assert llama_cards == [T0 - DAY_US, NOVEMBER_US + 12 * 3_600_000_000]  # both cards, in order
    assert ("mistral-7b@d4", None) in keys
    qwen_cards = [card for version, card in keys if version == "qwen2.5-7b@c3"]
    assert qwen_cards == [None]  # qwen's priced requests are on the EUR invoice
    for line in usd.lines:
        if line.price_effective_from_us is None:
            assert line.amount_micros == 0
    ordered = sorted(
        keys, key=lambda key: (key[0], key[1] is not None, key[1] if key[1] is not None else 0)
    )
    assert keys == ordered


def test_an_invoice_counts_only_its_tenant_and_period() -> None:
    start, end = NOVEMBER_US, NOVEMBER_US + DAY_US
    records = [
        make_record(record_id="at-start", finished_at_us=start, cost_micros=1),
        make_record(record_id="before", finished_at_us=start - 1, cost_micros=10),
        make_record(record_id="last", finished_at_us=end - 1, cost_micros=100),
        make_record(record_id="at-end", finished_at_us=end, cost_micros=1000),
        make_record(record_id="other", tenant_id="globex", finished_at_us=start, cost_micros=5),
    ]
    bill = invoice(records, "acme", Period(start, end))
    assert (bill.total_micros, bill.num_requests) == (101, 2)
    assert bill.lines == (
        InvoiceLine(
            model_version="llama-3.1-8b@a1",
            price_effective_from_us=T0 - DAY_US,
            num_requests=2,
            prompt_tokens=2000,
            cached_tokens=800,
            completion_tokens=400,
            amount_micros=101,
        ),
    )
    every = invoices(records, None, Period(start, end))
    assert [(bill.tenant_id, bill.total_micros) for bill in every] == [("acme", 101), ("globex", 5)]


def test_invoices_of_months_add_up_to_the_invoice_of_their_union() -> None:
    records = make_records()
    whole = Period(T0, T0 + 4 * DAY_US)
    october, november = month_of(T0), month_of(NOVEMBER_US)
    for tenant_id in ("acme", "globex"):
        for currency in ("EUR", "USD"):
            parts = [
                bill.total_micros
                for period in (october, november)
                for bill in invoices(records, tenant_id, period)
                if bill.currency == currency
            ]
            (total,) = [b for b in invoices(records, tenant_id, whole) if b.currency == currency]
            assert sum(parts) == total.total_micros


def test_invoice_refuses_to_mix_currencies() -> None:
    records = [
        make_record(record_id="usd", cost_micros=10),
        make_record(record_id="eur", cost_micros=20, currency="EUR"),
    ]
    period = Period(T0, T0 + DAY_US)
    with pytest.raises(InvoiceError, match=r"EUR, USD.*invoices\(\)"):
        invoice(records, "acme", period)
    assert [(b.currency, b.total_micros) for b in invoices(records, "acme", period)] == [
        ("EUR", 20),
        ("USD", 10),
    ]


def test_an_invoice_without_records_is_empty() -> None:
    period = Period(T0, T0 + DAY_US)
    bill = invoice([make_record(tenant_id="globex")], "acme", period, currency="EUR")
    assert (bill.tenant_id, bill.currency, bill.lines, bill.total_micros) == ("acme", "EUR", (), 0)
    assert (bill.num_requests, bill.unpriced_tokens) == (0, 0)
    assert invoices([], "acme", period) == []


def test_invoices_ignore_input_order() -> None:
    records = make_records()
    shuffled = records[::-1]
    period = Period(T0, T0 + 4 * DAY_US)
    assert invoices(shuffled, None, period) == invoices(records, None, period)

"""Exports: byte-stable, exact totals in every format (parsed back and summed), tenant and
period filtering, CSV escaping, CloudEvents' required attributes, streaming, and a golden CSV."""

from __future__ import annotations

import csv
import io
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import datetime
from decimal import Decimal
from typing import Any

import orjson
import pytest

from billing.export import (
    DAILY_COLUMNS,
    INVOICE_COLUMNS,
    REQUEST_COLUMNS,
    ExportFormat,
    ExportKind,
    content_type,
    export,
    filename,
    format_micros,
)
from billing.records import COLUMNS, RequestStatus, UsageRecord, format_unix_us
from billing.summaries import Period, day_of
from tests.billing.records_factory import DAY_US, NOVEMBER_US, T0, make_record, make_records

WHOLE = Period(T0, T0 + 4 * DAY_US)
SOURCE = "tandem/gateway"
ALL = [(kind, fmt) for kind in ExportKind for fmt in ExportFormat]


def run(
    kind: ExportKind,
    fmt: ExportFormat,
    records: Iterable[UsageRecord],
    *,
    tenant_id: str | None = None,
    period: Period = WHOLE,
) -> bytes:
    return b"".join(export(kind, fmt, records, tenant_id=tenant_id, period=period, source=SOURCE))


def csv_rows(data: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(data.decode(), newline="")))


def json_lines(data: bytes) -> list[dict[str, Any]]:
    assert data == b"" or data.endswith(b"\n")
    return [orjson.loads(line) for line in data.split(b"\n")[:-1]]


def parse(fmt: ExportFormat, data: bytes) -> list[dict[str, Any]]:
    """Rows (CSV, JSON lines) or the events' ``data`` (CloudEvents)."""
    if fmt is ExportFormat.CSV:
        return list(csv_rows(data))
    if fmt is ExportFormat.JSONL:
        return json_lines(data)
    return [event["data"] for event in json_lines(data)]


def by_currency(items: Iterable[tuple[str, int]]) -> Counter[str]:
    totals: Counter[str] = Counter()
    for currency, micros in items:
        totals[currency] += micros
    return totals


# --- golden ----------------------------------------------------------------------------------

GOLDEN_RECORDS = [
    UsageRecord(
        record_id="req-1",
        request_id="chatcmpl-1",
        tenant_id="acme",
        key_id="key-acme-1",
        model="llama-3.1-8b",
        model_version="llama-3.1-8b@a1",
        deployment="llama-stable",
        endpoint="chat",
        path="disaggregated",
        status=RequestStatus.COMPLETED,
        finish_reason="stop",
        error_code=None,
        moderation_action=None,
        prompt_tokens=1000,
        completion_tokens=200,
        cached_tokens=400,
        ttft_us=120000,
        e2e_us=1000000,
        started_at_us=1793318400000000,
        finished_at_us=1793318401000000,
        cost_micros=240,
        price_effective_from_us=1793232000000000,
        currency="USD",
    ),
    UsageRecord(
        record_id="req-2",
        request_id="chatcmpl-2",
        tenant_id="globex",
        key_id=None,
        model='odd, "model"',
        model_version="llama-3.1-8b@a1",
        deployment="smol",
        endpoint="completions",
        path=None,
        status=RequestStatus.FAILED,
        finish_reason=None,
        error_code="engine_error",
        moderation_action=None,
        prompt_tokens=12,
        completion_tokens=0,
        cached_tokens=0,
        ttft_us=None,
        e2e_us=1500,
        started_at_us=1793318402000000,
        finished_at_us=1793318402001500,
        cost_micros=0,
        price_effective_from_us=None,
        currency="USD",
    ),
    UsageRecord(
        record_id="req-3",
        request_id="chatcmpl-3",
        tenant_id="acme",
        key_id="key-acme-1",
        model="llama-3.1-8b",
        model_version="llama-3.1-8b@a1",
        deployment="llama-stable",
        endpoint="chat",
        path="colocated",
        status=RequestStatus.ABORTED,
        finish_reason=None,
        error_code=None,
        moderation_action="redact",
        prompt_tokens=5,
        completion_tokens=3,
        cached_tokens=5,
        ttft_us=120000,
        e2e_us=2999999,
        started_at_us=1793404797000000,
        finished_at_us=1793404799999999,
        cost_micros=1234567,
        price_effective_from_us=1793232000000000,
        currency="USD",
    ),
]

GOLDEN_CSV = (
    "record_id,request_id,tenant_id,key_id,model,model_version,deployment,endpoint,path,status,"
    "finish_reason,error_code,moderation_action,prompt_tokens,completion_tokens,cached_tokens,"
    "ttft_us,e2e_us,started_at_us,started_at,finished_at_us,finished_at,cost_micros,cost,"
    "price_effective_from_us,price_effective_from,currency\n"
    "req-1,chatcmpl-1,acme,key-acme-1,llama-3.1-8b,llama-3.1-8b@a1,llama-stable,chat,"
    "disaggregated,completed,stop,,,1000,200,400,120000,1000000,"
    "1793318400000000,2026-10-30T00:00:00.000000Z,1793318401000000,2026-10-30T00:00:01.000000Z,"
    "240,0.000240,1793232000000000,2026-10-29T00:00:00.000000Z,USD\n"
    'req-2,chatcmpl-2,globex,,"odd, ""model""",llama-3.1-8b@a1,smol,completions,,failed,,'
    "engine_error,,12,0,0,,1500,"
    "1793318402000000,2026-10-30T00:00:02.000000Z,1793318402001500,2026-10-30T00:00:02.001500Z,"
    "0,0.000000,,,USD\n"
    "req-3,chatcmpl-3,acme,key-acme-1,llama-3.1-8b,llama-3.1-8b@a1,llama-stable,chat,"
    "colocated,aborted,,,redact,5,3,5,120000,2999999,"
    "1793404797000000,2026-10-30T23:59:57.000000Z,1793404799999999,2026-10-30T23:59:59.999999Z,"
    "1234567,1.234567,1793232000000000,2026-10-29T00:00:00.000000Z,USD\n"
)


def test_golden_requests_csv() -> None:
    assert T0 == 1793318400000000  # 2026-10-30T00:00:00Z, the golden rows' day
    data = run(
        ExportKind.REQUESTS, ExportFormat.CSV, GOLDEN_RECORDS, period=Period(T0, T0 + DAY_US)
    )
    assert data.decode() == GOLDEN_CSV


def test_golden_invoice_csv() -> None:
    data = run(
        ExportKind.INVOICE,
        ExportFormat.CSV,
        GOLDEN_RECORDS,
        tenant_id="acme",
        period=Period(T0, T0 + DAY_US),
    )
    head = "acme,USD,1793318400000000,2026-10-30T00:00:00.000000Z,1793404800000000,2026-10-31T00:00:00.000000Z"
    assert data.decode() == (
        ",".join(INVOICE_COLUMNS) + "\n"
        f"line,{head},llama-3.1-8b@a1,1793232000000000,2026-10-29T00:00:00.000000Z,"
        "2,1005,405,203,0,1234807,1.234807\n"
        f"total,{head},,,,2,1005,405,203,0,1234807,1.234807\n"
    )


# --- stability -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "fmt"), ALL)
def test_the_same_export_twice_gives_identical_bytes(kind: ExportKind, fmt: ExportFormat) -> None:
    first = run(kind, fmt, make_records())
    second = run(kind, fmt, iter(make_records()))
    assert first == second
    assert len(first) > 1000
    assert b"\r\n" not in first


@pytest.mark.parametrize("kind", [ExportKind.DAILY, ExportKind.INVOICE])
@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_summaries_do_not_depend_on_input_order(kind: ExportKind, fmt: ExportFormat) -> None:
    records = make_records()
    shuffled = records[:]
    random.Random(11).shuffle(shuffled)
    assert run(kind, fmt, shuffled) == run(kind, fmt, records)


def test_requests_stream_in_the_order_given() -> None:
    records = make_records()
    rows = json_lines(run(ExportKind.REQUESTS, ExportFormat.JSONL, records))
    assert [row["record_id"] for row in rows] == [record.record_id for record in records]


# --- totals ----------------------------------------------------------------------------------


def assert_money_strings_match(row: dict[str, Any]) -> None:
    for micros_name, text_name in (("cost_micros", "cost"), ("amount_micros", "amount")):
        if micros_name in row:
            assert Decimal(row[text_name]) * 1_000_000 == Decimal(row[micros_name])
            assert re.fullmatch(r"-?\d+\.\d{6}", row[text_name])


@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_request_rows_total_the_records(fmt: ExportFormat) -> None:
    records = make_records()
    rows = parse(fmt, run(ExportKind.REQUESTS, fmt, records))
    assert len(rows) == len(records)
    for row, record in zip(rows, records, strict=True):
        assert_money_strings_match(row)
        assert int(row["cost_micros"]) == record.cost_micros
        assert int(row["finished_at_us"]) == record.finished_at_us
        assert row["finished_at"] == format_unix_us(record.finished_at_us)
        if fmt is not ExportFormat.CSV:  # JSON keeps types: numbers, and null for None
            assert UsageRecord.from_dict(row) == record
    for name in ("cost_micros", "prompt_tokens", "completion_tokens", "cached_tokens"):
        assert sum(int(row[name]) for row in rows) == sum(getattr(r, name) for r in records)


@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_daily_rows_total_the_records(fmt: ExportFormat) -> None:
    records = make_records()
    rows = parse(fmt, run(ExportKind.DAILY, fmt, records))
    for row in rows:
        assert_money_strings_match(row)
    assert by_currency((row["currency"], int(row["cost_micros"])) for row in rows) == by_currency(
        (r.currency, r.cost_micros) for r in records
    )
    assert sum(int(row["num_requests"]) for row in rows) == len(records)
    for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        assert sum(int(row[name]) for row in rows) == sum(getattr(r, name) for r in records)
    assert {row["day"] for row in rows} == {day_of(r.finished_at_us) for r in records}


@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_invoices_total_the_records(fmt: ExportFormat) -> None:
    records = make_records()
    data = run(ExportKind.INVOICE, fmt, records)
    if fmt is ExportFormat.CSV:
        rows = csv_rows(data)
        lines = [row for row in rows if row["row"] == "line"]
        totals = [row for row in rows if row["row"] == "total"]
        for total in totals:
            mine = [
                row
                for row in lines
                if (row["tenant_id"], row["currency"]) == (total["tenant_id"], total["currency"])
            ]
            for name in ("amount_micros", "num_requests", "prompt_tokens", "unpriced_tokens"):
                assert int(total[name]) == sum(int(row[name]) for row in mine)
        amounts = [(row["currency"], int(row["amount_micros"])) for row in lines]
        invoice_totals = [(row["currency"], int(row["amount_micros"])) for row in totals]
        for row in rows:
            assert_money_strings_match(row)
    else:
        bills = parse(fmt, data)
        amounts = [
            (bill["currency"], line["amount_micros"]) for bill in bills for line in bill["lines"]
        ]
        invoice_totals = [(bill["currency"], bill["total_micros"]) for bill in bills]
        for bill in bills:
            assert Decimal(bill["total"]) * 1_000_000 == bill["total_micros"]
            for line in bill["lines"]:
                assert_money_strings_match(line)
    expected = by_currency((r.currency, r.cost_micros) for r in records)
    assert by_currency(amounts) == expected
    assert by_currency(invoice_totals) == expected
    assert len(invoice_totals) == 8  # four tenants, each with USD and EUR records


# --- filtering -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "fmt"), ALL)
def test_a_tenant_export_holds_only_that_tenant(kind: ExportKind, fmt: ExportFormat) -> None:
    records = make_records()
    data = run(kind, fmt, records, tenant_id="globex")
    rows = parse(fmt, data)
    assert rows
    assert {row["tenant_id"] for row in rows} == {"globex"}
    if fmt is ExportFormat.CLOUDEVENTS:
        assert {event["subject"] for event in json_lines(data)} == {"globex"}
    mine = [r for r in records if r.tenant_id == "globex"]
    # The same bytes as exporting the tenant's records alone: nothing of others leaks in.
    assert data == run(kind, fmt, mine)


@pytest.mark.parametrize(("kind", "fmt"), ALL)
def test_an_export_holds_only_its_period(kind: ExportKind, fmt: ExportFormat) -> None:
    records = make_records()
    november = Period(NOVEMBER_US, NOVEMBER_US + 2 * DAY_US)
    inside = [r for r in records if november.contains(r.finished_at_us)]
    assert any(r.finished_at_us == NOVEMBER_US for r in inside)
    assert any(r.finished_at_us == NOVEMBER_US - 1 for r in records)
    assert run(kind, fmt, records, period=november) == run(kind, fmt, inside, period=november)


def test_an_unknown_tenant_exports_nothing_but_the_header() -> None:
    records = make_records()
    for kind, columns in (
        (ExportKind.REQUESTS, REQUEST_COLUMNS),
        (ExportKind.DAILY, DAILY_COLUMNS),
        (ExportKind.INVOICE, INVOICE_COLUMNS),
    ):
        data = run(kind, ExportFormat.CSV, records, tenant_id="nobody")
        assert data.decode() == ",".join(columns) + "\n"
        assert run(kind, ExportFormat.JSONL, records, tenant_id="nobody") == b""


# --- CSV escaping and values -----------------------------------------------------------------

ODD = [
    "comma, inside",
    'say "hi"',
    "two\nlines",
    "carriage\rreturn\r\n",
    " leading and trailing ",
    "ünïcødé ✓ 模型",
    "=1+1",
    '"',
    "",
]


@pytest.mark.parametrize("odd", ODD)
def test_csv_round_trips_odd_strings(odd: str) -> None:
    records = [
        make_record(record_id="r1", model=odd, deployment=odd, finish_reason=odd),
        make_record(record_id="r2", model="plain"),
    ]
    for kind in (ExportKind.REQUESTS, ExportKind.DAILY):
        rows = csv_rows(run(kind, ExportFormat.CSV, records))
        assert len(rows) == 2
        assert {row["model"] for row in rows} == {odd, "plain"}
    rows = csv_rows(run(ExportKind.REQUESTS, ExportFormat.CSV, records))
    assert rows[0]["deployment"] == rows[0]["finish_reason"] == odd
    assert list(rows[0]) == list(REQUEST_COLUMNS)
    jsonl = json_lines(run(ExportKind.REQUESTS, ExportFormat.JSONL, records))
    assert jsonl[0]["model"] == odd


def test_none_is_empty_in_csv_and_null_in_json() -> None:
    record = make_record(key_id=None, path=None, ttft_us=None, price_effective_from_us=None)
    row = csv_rows(run(ExportKind.REQUESTS, ExportFormat.CSV, [record]))[0]
    assert (row["key_id"], row["ttft_us"], row["price_effective_from"]) == ("", "", "")
    (obj,) = json_lines(run(ExportKind.REQUESTS, ExportFormat.JSONL, [record]))
    assert obj["key_id"] is None
    assert obj["price_effective_from_us"] is None
    assert obj["price_effective_from"] is None
    assert obj["prompt_tokens"] == 1000  # a JSON number, not a string


def test_columns_follow_the_ledger() -> None:
    derived = {"cost", "started_at", "finished_at", "price_effective_from"}
    assert tuple(c for c in REQUEST_COLUMNS if c not in derived) == COLUMNS
    for source, extra in (
        ("cost_micros", "cost"),
        ("started_at_us", "started_at"),
        ("finished_at_us", "finished_at"),
        ("price_effective_from_us", "price_effective_from"),
    ):
        assert REQUEST_COLUMNS.index(extra) == REQUEST_COLUMNS.index(source) + 1
    row = json_lines(run(ExportKind.REQUESTS, ExportFormat.JSONL, [make_record()]))[0]
    assert tuple(row) == REQUEST_COLUMNS
    row = json_lines(run(ExportKind.DAILY, ExportFormat.JSONL, [make_record()]))[0]
    assert tuple(row) == DAILY_COLUMNS


@pytest.mark.parametrize(
    ("micros", "text"),
    [
        (0, "0.000000"),
        (1, "0.000001"),
        (999_999, "0.999999"),
        (1_000_000, "1.000000"),
        (1_234_567, "1.234567"),
        (12_345_678_901_234_567, "12345678901.234567"),
        (-5, "-0.000005"),
        (-1_500_000, "-1.500000"),
    ],
)
def test_format_micros_is_exact(micros: int, text: str) -> None:
    assert format_micros(micros) == text


# --- CloudEvents -----------------------------------------------------------------------------

_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")


def assert_valid_cloudevent(event: dict[str, Any]) -> None:
    """CloudEvents 1.0, structured JSON mode: the required context attributes, the optional
    ones we set, and the naming rule for attributes."""
    for name in ("id", "source", "specversion", "type"):
        assert isinstance(event[name], str)
        assert event[name]
    assert event["specversion"] == "1.0"
    assert not re.search(r"\s", event["source"])  # a URI-reference
    for name in event:
        assert re.fullmatch(r"[a-z0-9]{1,20}", name), name
    assert _RFC3339.fullmatch(event["time"])
    assert datetime.fromisoformat(event["time"].replace("Z", "+00:00")).tzinfo is not None
    assert isinstance(event["subject"], str)
    assert event["subject"]
    assert event["datacontenttype"] == "application/json"
    assert isinstance(event["data"], dict)


@pytest.mark.parametrize("kind", list(ExportKind))
def test_cloudevents_are_valid_and_unique(kind: ExportKind) -> None:
    events = json_lines(run(kind, ExportFormat.CLOUDEVENTS, make_records()))
    assert events
    for event in events:
        assert_valid_cloudevent(event)
        assert event["source"] == SOURCE
        assert event["subject"] == event["data"]["tenant_id"]
    assert {event["type"] for event in events} == {
        {
            ExportKind.REQUESTS: "com.tandem.usage.request",
            ExportKind.DAILY: "com.tandem.usage.daily",
            ExportKind.INVOICE: "com.tandem.invoice",
        }[kind]
    }
    assert len({event["id"] for event in events}) == len(events)


def test_request_events_carry_the_record() -> None:
    records = make_records()
    events = json_lines(run(ExportKind.REQUESTS, ExportFormat.CLOUDEVENTS, records))
    for event, record in zip(events, records, strict=True):
        assert event["id"] == record.record_id
        assert event["time"] == format_unix_us(record.finished_at_us)
        data = event["data"]
        # Numbers stay JSON numbers, so a meter's JSONPath ($.prompt_tokens) can sum them.
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "cost_micros"):
            assert type(data[name]) is int
        assert (data["model"], data["model_version"], data["status"]) == (
            record.model,
            record.model_version,
            record.status.value,
        )


def test_daily_event_ids_are_stable_for_full_days_and_distinct_for_partial_ones() -> None:
    records = make_records()

    def ids(period: Period) -> dict[tuple[str, str, str, str, str], str]:
        events = json_lines(run(ExportKind.DAILY, ExportFormat.CLOUDEVENTS, records, period=period))
        for event in events:
            assert event["time"] == event["data"]["day"] + "T00:00:00.000000Z"
        return {
            (
                e["data"]["day"],
                e["subject"],
                e["data"]["model_version"],
                e["data"]["deployment"],
                e["data"]["currency"],
            ): e["id"]
            for e in events
        }

    whole = ids(WHOLE)
    november = ids(Period(NOVEMBER_US, NOVEMBER_US + 2 * DAY_US))
    assert november
    assert all(whole[key] == event_id for key, event_id in november.items())
    half_day = ids(Period(NOVEMBER_US, NOVEMBER_US + DAY_US // 2))
    assert half_day
    assert not set(half_day.values()) & set(whole.values())


def test_invoice_events_are_timed_at_the_period_end() -> None:
    events = json_lines(run(ExportKind.INVOICE, ExportFormat.CLOUDEVENTS, make_records()))
    assert {event["time"] for event in events} == {format_unix_us(WHOLE.end_us)}
    other = json_lines(
        run(
            ExportKind.INVOICE,
            ExportFormat.CLOUDEVENTS,
            make_records(),
            period=Period(T0, T0 + 3 * DAY_US),
        )
    )
    assert not {e["id"] for e in events} & {e["id"] for e in other}


# --- streaming and arguments -----------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_requests_stream_without_reading_everything_first(fmt: ExportFormat) -> None:
    records = make_records(3000)
    consumed = 0

    def counting() -> Iterator[UsageRecord]:
        nonlocal consumed
        for record in records:
            consumed += 1
            yield record

    chunks = export(
        ExportKind.REQUESTS, fmt, counting(), tenant_id=None, period=WHOLE, source=SOURCE
    )
    first = next(chunks)
    assert 0 < consumed < len(records)
    rest = list(chunks)
    assert consumed == len(records)
    assert len(rest) >= 2
    assert first + b"".join(rest) == run(ExportKind.REQUESTS, fmt, records)


def test_arguments_are_checked_when_export_is_called() -> None:
    with pytest.raises(ValueError, match="source"):
        export(
            ExportKind.REQUESTS,
            ExportFormat.CLOUDEVENTS,
            [],
            tenant_id=None,
            period=WHOLE,
            source="",
        )
    # Plain strings, as a CLI or a query parameter gives them, are checked and accepted.
    xml: Any = "xml"
    with pytest.raises(ValueError, match="xml"):
        export(ExportKind.REQUESTS, xml, [], tenant_id=None, period=WHOLE, source=SOURCE)
    daily: Any = "daily"
    csv_text: Any = "csv"
    data = b"".join(
        export(daily, csv_text, [make_record()], tenant_id=None, period=WHOLE, source="")
    )
    assert data.startswith(b"day,tenant_id,")


def test_content_type_and_filename() -> None:
    assert content_type(ExportFormat.CSV) == "text/csv; charset=utf-8"
    assert content_type(ExportFormat.JSONL) == "application/x-ndjson"
    assert content_type(ExportFormat.CLOUDEVENTS) == "application/x-ndjson"
    november = Period(NOVEMBER_US, NOVEMBER_US + 30 * DAY_US)
    assert (
        filename(ExportKind.DAILY, ExportFormat.CSV, "acme", november)
        == "tandem-daily-acme-20261101-20261201.csv"
    )
    assert (
        filename(
            ExportKind.REQUESTS,
            ExportFormat.CLOUDEVENTS,
            None,
            Period(T0 + 1, NOVEMBER_US + 3_600_000_000),
        )
        == "tandem-requests-all-20261030T000000.000001Z-20261101T010000Z.cloudevents.jsonl"
    )
    assert (
        filename(ExportKind.INVOICE, ExportFormat.JSONL, "../evil tenant/x", november)
        == "tandem-invoice-.._evil_tenant_x-20261101-20261201.jsonl"
    )

"""Ledger exports for finance: per-request rows, daily summaries and invoices, as CSV, JSON
lines or CloudEvents (JSON lines, structured mode, spec 1.0, e.g. for OpenMeter).

The same records and period always give the same bytes, so an export can be re-run, diffed and
checksummed: columns and JSON keys come in one fixed order (``REQUEST_COLUMNS``,
``DAILY_COLUMNS``, ``INVOICE_COLUMNS``; JSON keys in the same order, not sorted, so a JSON line
reads like its CSV row), lines end in ``\\n``, counts are integers, None is an empty CSV field or
JSON ``null``, and nothing depends on when the export ran (no export timestamps, no random ids:
a CloudEvent's ``id`` is the record id or a hash of the summary's key). Every amount is given
as integer micro-units with its exact decimal string beside it (``cost_micros`` 1234, ``cost``
"0.001234"), and every instant as Unix microseconds with its RFC 3339 form beside it.

Per-request exports stream in store order ((finished_at_us, record_id)); summaries are sorted
by their keys, so they do not depend on the order records arrive in.
"""

from __future__ import annotations

import csv
import enum
import hashlib
import io
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, fields
from typing import Any

import orjson

from billing.records import COLUMNS, MICROS_PER_UNIT, UsageRecord, format_unix_us
from billing.summaries import (
    DailySummary,
    Invoice,
    Period,
    daily_summaries,
    day_period,
    invoices,
)

_CHUNK_SIZE = 64 * 1024  # large enough that a web server is not handed one tiny write per row

Row = dict[str, Any]


class ExportKind(enum.StrEnum):
    """What is exported."""

    REQUESTS = "requests"
    DAILY = "daily"
    INVOICE = "invoice"


class ExportFormat(enum.StrEnum):
    """How it is written."""

    CSV = "csv"
    JSONL = "jsonl"
    CLOUDEVENTS = "cloudevents"


CLOUDEVENT_TYPES: dict[ExportKind, str] = {
    ExportKind.REQUESTS: "com.tandem.usage.request",
    ExportKind.DAILY: "com.tandem.usage.daily",
    ExportKind.INVOICE: "com.tandem.invoice",
}
"""The CloudEvents ``type`` of each kind (what an OpenMeter meter's ``eventType`` matches)."""


def format_micros(micros: int) -> str:
    """The exact decimal string of integer micro-units: 1234 -> ``"0.001234"``."""
    whole, fraction = divmod(abs(micros), MICROS_PER_UNIT)
    sign = "-" if micros < 0 else ""
    return f"{sign}{whole}.{fraction:06d}"


# A derived column follows its source column: money as a decimal string, instants as RFC 3339.
# Durations (ttft_us, e2e_us) stay plain integers.
_DERIVED: dict[str, tuple[str, Callable[[int], str]]] = {
    "cost_micros": ("cost", format_micros),
    "amount_micros": ("amount", format_micros),
    "total_micros": ("total", format_micros),
    "started_at_us": ("started_at", format_unix_us),
    "finished_at_us": ("finished_at", format_unix_us),
    "price_effective_from_us": ("price_effective_from", format_unix_us),
    "period_start_us": ("period_start", format_unix_us),
    "period_end_us": ("period_end", format_unix_us),
}


def _columns(names: Iterable[str]) -> tuple[str, ...]:
    columns: list[str] = []
    for name in names:
        columns.append(name)
        if name in _DERIVED:
            columns.append(_DERIVED[name][0])
    return tuple(columns)


def _with_derived(values: Row) -> Row:
    row: Row = {}
    for name, value in values.items():
        row[name] = value
        if name in _DERIVED:
            derived, render = _DERIVED[name]
            row[derived] = None if value is None else render(value)
    return row


REQUEST_COLUMNS = _columns(COLUMNS)
"""Per-request columns: ``billing.records.COLUMNS`` with the derived ones beside their source."""

DAILY_COLUMNS = _columns(field.name for field in fields(DailySummary))
"""Daily summary columns (``DailySummary``'s fields, ``cost`` after ``cost_micros``)."""

_INVOICE_HEAD = ("tenant_id", "currency", "period_start_us", "period_end_us")
_LINE_FIELDS = (
    "model_version",
    "price_effective_from_us",
    "num_requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "unpriced_tokens",
    "amount_micros",
)

INVOICE_COLUMNS = ("row", *_columns(_INVOICE_HEAD), *_columns(_LINE_FIELDS))
"""Invoice CSV columns. ``row`` is ``line`` for each invoice line and ``total`` for the one
row closing each invoice (its model version and price card empty, its counts the sums)."""


def request_row(record: UsageRecord) -> Row:
    """One record as an export row, in ``REQUEST_COLUMNS`` order."""
    return _with_derived(record.to_dict())


def daily_row(summary: DailySummary) -> Row:
    """One daily summary as an export row, in ``DAILY_COLUMNS`` order."""
    return _with_derived(asdict(summary))


def _line_rows(bill: Invoice) -> list[Row]:
    return [
        {
            "model_version": line.model_version,
            "price_effective_from_us": line.price_effective_from_us,
            "num_requests": line.num_requests,
            "prompt_tokens": line.prompt_tokens,
            "cached_tokens": line.cached_tokens,
            "completion_tokens": line.completion_tokens,
            "unpriced_tokens": (
                line.prompt_tokens + line.completion_tokens
                if line.price_effective_from_us is None
                else 0
            ),
            "amount_micros": line.amount_micros,
        }
        for line in bill.lines
    ]


def _invoice_head(bill: Invoice) -> Row:
    return {
        "tenant_id": bill.tenant_id,
        "currency": bill.currency,
        "period_start_us": bill.period.start_us,
        "period_end_us": bill.period.end_us,
    }


def _token_totals(lines: list[Row]) -> Row:
    """An invoice's token counts, summed over its lines (in the exports' column order)."""
    return {
        name: sum(line[name] for line in lines)
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens")
    }


def invoice_object(bill: Invoice) -> Row:
    """One invoice as a JSON object: its head, totals, then its ``lines``."""
    lines = _line_rows(bill)
    return _with_derived(
        {
            **_invoice_head(bill),
            "num_requests": bill.num_requests,
            **_token_totals(lines),
            "unpriced_tokens": bill.unpriced_tokens,
            "total_micros": bill.total_micros,
        }
    ) | {"lines": [_with_derived(line) for line in lines]}


def invoice_csv_rows(bill: Invoice) -> list[Row]:
    """One invoice as CSV rows: a ``line`` row per line, then its ``total`` row."""
    head = _invoice_head(bill)
    lines = _line_rows(bill)
    total: Row = {
        "model_version": None,
        "price_effective_from_us": None,
        "num_requests": bill.num_requests,
        **_token_totals(lines),
        "unpriced_tokens": bill.unpriced_tokens,
        "amount_micros": bill.total_micros,
    }
    return [
        _with_derived({"row": kind, **head, **values})
        for kind, values in [*(("line", line) for line in lines), ("total", total)]
    ]


def _stable_id(prefix: str, *parts: str | int) -> str:
    # A JSON array, not a joined string: no choice of separator can make two keys collide.
    digest = hashlib.sha256(orjson.dumps(parts)).hexdigest()
    return f"{prefix}-{digest[:32]}"


def cloudevent(
    kind: ExportKind, *, source: str, event_id: str, time_us: int, subject: str, data: Row
) -> Row:
    """A CloudEvents 1.0 event in structured JSON mode (required attributes first)."""
    return {
        "specversion": "1.0",
        "type": CLOUDEVENT_TYPES[kind],
        "source": source,
        "id": event_id,
        "time": format_unix_us(time_us),
        "subject": subject,
        "datacontenttype": "application/json",
        "data": data,
    }


def _request_event(record: UsageRecord, source: str) -> Row:
    return cloudevent(
        ExportKind.REQUESTS,
        source=source,
        event_id=record.record_id,
        time_us=record.finished_at_us,
        subject=record.tenant_id,
        data=request_row(record),
    )


def _daily_event(summary: DailySummary, period: Period, source: str) -> Row:
    day = day_period(summary.day)
    # The id covers the part of the day the export saw: a full day gets the same id from every
    # export that spans it (a metering system drops the repeat), while a partial day (a period
    # ending mid-day) gets its own id, so it never shadows the full day exported later.
    start_us, end_us = max(day.start_us, period.start_us), min(day.end_us, period.end_us)
    return cloudevent(
        ExportKind.DAILY,
        source=source,
        event_id=_stable_id(
            "daily",
            summary.day,
            summary.tenant_id,
            summary.model,
            summary.model_version,
            summary.deployment,
            summary.currency,
            start_us,
            end_us,
        ),
        time_us=day.start_us,
        subject=summary.tenant_id,
        data=daily_row(summary),
    )


def _invoice_event(bill: Invoice, source: str) -> Row:
    return cloudevent(
        ExportKind.INVOICE,
        source=source,
        event_id=_stable_id(
            "invoice", bill.tenant_id, bill.currency, bill.period.start_us, bill.period.end_us
        ),
        time_us=bill.period.end_us,
        subject=bill.tenant_id,
        data=invoice_object(bill),
    )


def _csv_chunks(columns: tuple[str, ...], rows: Iterable[Row]) -> Iterator[bytes]:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([row[name] for name in columns])
        if buffer.tell() >= _CHUNK_SIZE:
            yield buffer.getvalue().encode()
            buffer.seek(0)
            buffer.truncate()
    if buffer.tell():
        yield buffer.getvalue().encode()


def _jsonl_chunks(objects: Iterable[Row]) -> Iterator[bytes]:
    buffer = bytearray()
    for item in objects:
        buffer += orjson.dumps(item)
        buffer += b"\n"
        if len(buffer) >= _CHUNK_SIZE:
            yield bytes(buffer)
            buffer.clear()
    if buffer:
        yield bytes(buffer)


def export(
    kind: ExportKind,
    fmt: ExportFormat,
    records: Iterable[UsageRecord],
    *,
    tenant_id: str | None,
    period: Period,
    source: str,
) -> Iterator[bytes]:
    """The export's bytes, in chunks (records are read as the chunks are).

    Only records of ``tenant_id`` (every tenant when None) that finished in ``period`` count,
    even if the store already filtered: an export is exactly its tenant and period. ``source``
    is the CloudEvents ``source`` (e.g. ``tandem/gateway``). An invoice export has one invoice
    per tenant and currency with records; none when there are no records. Raises
    ``ValueError`` for an unknown kind or format, or an empty ``source`` for CloudEvents."""
    kind = ExportKind(kind)
    fmt = ExportFormat(fmt)
    if fmt is ExportFormat.CLOUDEVENTS and not source:
        raise ValueError("source must name the exporter for CloudEvents, e.g. tandem/gateway")
    selected = (
        record
        for record in records
        if (tenant_id is None or record.tenant_id == tenant_id)
        and period.contains(record.finished_at_us)
    )
    if kind is ExportKind.REQUESTS:
        if fmt is ExportFormat.CSV:
            return _csv_chunks(REQUEST_COLUMNS, map(request_row, selected))
        if fmt is ExportFormat.JSONL:
            return _jsonl_chunks(map(request_row, selected))
        return _jsonl_chunks(_request_event(record, source) for record in selected)
    if kind is ExportKind.DAILY:
        return _export_daily(fmt, selected, period, source)
    return _export_invoices(fmt, selected, period, source)


def _export_daily(
    fmt: ExportFormat, records: Iterable[UsageRecord], period: Period, source: str
) -> Iterator[bytes]:
    summaries = daily_summaries(records)
    if fmt is ExportFormat.CSV:
        yield from _csv_chunks(DAILY_COLUMNS, map(daily_row, summaries))
    elif fmt is ExportFormat.JSONL:
        yield from _jsonl_chunks(map(daily_row, summaries))
    else:
        yield from _jsonl_chunks(_daily_event(summary, period, source) for summary in summaries)


def _export_invoices(
    fmt: ExportFormat, records: Iterable[UsageRecord], period: Period, source: str
) -> Iterator[bytes]:
    bills = invoices(records, None, period)  # records are already this export's tenant's
    if fmt is ExportFormat.CSV:
        yield from _csv_chunks(
            INVOICE_COLUMNS, (row for bill in bills for row in invoice_csv_rows(bill))
        )
    elif fmt is ExportFormat.JSONL:
        yield from _jsonl_chunks(map(invoice_object, bills))
    else:
        yield from _jsonl_chunks(_invoice_event(bill, source) for bill in bills)


def content_type(fmt: ExportFormat) -> str:
    """The HTTP ``Content-Type`` of an export in ``fmt``."""
    if ExportFormat(fmt) is ExportFormat.CSV:
        return "text/csv; charset=utf-8"
    # CloudEvents too: application/cloudevents-batch+json is one JSON array, not JSON lines.
    return "application/x-ndjson"


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def filename(kind: ExportKind, fmt: ExportFormat, tenant_id: str | None, period: Period) -> str:
    """A suggested file name, e.g. ``tandem-daily-acme-20261101-20261201.csv``."""
    tenant = _UNSAFE.sub("_", tenant_id) if tenant_id else "all"
    extension = {
        ExportFormat.CSV: "csv",
        ExportFormat.JSONL: "jsonl",
        ExportFormat.CLOUDEVENTS: "cloudevents.jsonl",
    }[ExportFormat(fmt)]
    start, end = _instant_label(period.start_us), _instant_label(period.end_us)
    return f"tandem-{ExportKind(kind)}-{tenant}-{start}-{end}.{extension}"


def _instant_label(at_us: int) -> str:
    text = format_unix_us(at_us)  # 2026-11-01T10:00:00.000000Z
    date, time = text[:10].replace("-", ""), text[11:26].replace(":", "")
    if time == "000000.000000":
        return date
    return f"{date}T{time.removesuffix('.000000')}Z"

"""Billing over HTTP: exports, price cards, budgets, alerts, measured cost, the request log
(admin, ``/admin/v1/...``), and ``GET /v1/usage``, where a tenant's own key reads its own usage.

Exports stream: rows leave as the ledger is read, so a month of records never sits in memory.
What was recorded before the call is flushed first, so an export includes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Query
from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from billing.budgets import BudgetStatus
from billing.cost import figures_to_json
from billing.export import ExportFormat, ExportKind, content_type, export, filename, format_micros
from billing.prices import PriceCard, PriceError, parse_price
from billing.records import MICROS_PER_UNIT, UsageRecord, format_unix_us
from billing.service import Billing, now_us
from billing.store import AccountSettings, LedgerUnavailableError, PriceConflictError, UsageQuery
from billing.summaries import (
    Period,
    PeriodError,
    daily_summaries,
    month_of,
    parse_instant,
    parse_period,
)
from core.errors import ConflictError, InvalidRequestError, NotFoundError, StoreUnavailableError
from gateway.admin.deps import (
    AdminDep,
    BillingDep,
    RegistryDep,
    get_billing,
    require_admin,
    resolve_tenant,
)

admin_router = APIRouter(
    prefix="/admin/v1", tags=["billing"], dependencies=[Depends(require_admin)]
)
tenant_router = APIRouter(tags=["usage"])

_SOURCE = "tandem/gateway"


class PriceCardCreate(BaseModel):
    """``POST /admin/v1/billing/prices``: a new price card (cards are never edited)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model_version: Annotated[str, Field(min_length=1)]
    """The model version it prices (``/admin/v1/billing/cost`` and ledger rows show them)."""
    # Strict numbers: a JSON boolean is not a price (false was taken as 0).
    input_per_1k: str | StrictFloat
    """Price per 1k uncached prompt tokens, as a decimal string (``"0.00015"``)."""
    output_per_1k: str | StrictFloat
    """Price per 1k completion tokens."""
    cached_input_per_1k: str | StrictFloat | None = None
    """Price per 1k prompt tokens served from the prefix cache; default: ``input_per_1k``."""
    effective_from: str | None = None
    """RFC 3339 time from which requests are priced by it; default: now. Never in the past."""


class AccountUpdate(BaseModel):
    """``PATCH /admin/v1/tenants/{tenant}/billing``; an omitted field keeps its value."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    monthly_budget: str | StrictFloat | None = None
    """Spend limit per UTC calendar month in currency units (``"250.00"``); null: unlimited."""
    alert_thresholds_pct: list[Annotated[StrictInt, Field(ge=1, le=1000)]] | None = None
    """Percentages of the budget at which an alert fires, e.g. ``[50, 80, 100]``."""
    request_log: StrictBool | None = None
    """Keep this tenant's prompts and outputs (PII scrubbed)."""
    request_log_retention_s: Annotated[StrictInt, Field(ge=60)] | None = None
    """How long kept prompts and outputs live."""


@admin_router.get("/billing/export")
async def export_usage(
    billing: BillingDep,
    registry: RegistryDep,
    from_: Annotated[str, Query(alias="from")],
    to: str,
    kind: ExportKind = ExportKind.REQUESTS,
    fmt: Annotated[ExportFormat, Query(alias="format")] = ExportFormat.CSV,
    tenant: str | None = None,
) -> StreamingResponse:
    """Per-request rows, daily summaries or invoices of ``[from, to)`` (UTC), as CSV, JSON
    lines or CloudEvents; one tenant (id or name) or all. The same period gives the same bytes."""
    tenant_id = (await resolve_tenant(registry, tenant)).tenant_id if tenant else None
    return await _export(billing, _period(from_, to), kind, fmt, tenant_id)


@admin_router.get("/billing/prices")
async def list_prices(billing: BillingDep) -> dict[str, Any]:
    """Every price card, by model version and effective date."""
    return {"object": "list", "data": [_card(card) for card in billing.prices.cards()]}


@admin_router.post("/billing/prices", status_code=201)
async def add_price(body: PriceCardCreate, billing: BillingDep) -> dict[str, Any]:
    """Add a card; it prices requests that end from its effective date on. Past records keep
    the price they were billed at."""
    try:
        effective = now_us() if body.effective_from is None else _instant(body.effective_from)
        input_price = parse_price(body.input_per_1k, "input_per_1k")
        card = PriceCard(
            model_version=body.model_version,
            effective_from_us=effective,
            input_per_1k=input_price,
            output_per_1k=parse_price(body.output_per_1k, "output_per_1k"),
            cached_input_per_1k=input_price
            if body.cached_input_per_1k is None
            else parse_price(body.cached_input_per_1k, "cached_input_per_1k"),
            currency=billing.config.currency,
        )
        await _ledger(billing.add_price_card(card))
    except PriceError as exc:
        raise InvalidRequestError(str(exc)) from exc
    except PriceConflictError as exc:
        raise ConflictError(
            f"A price card for {body.model_version} effective at that time exists; cards are "
            "never edited: add one with a later effective_from."
        ) from exc
    return _card(card)


@admin_router.get("/tenants/{tenant}/billing")
async def get_account(tenant: str, billing: BillingDep, registry: RegistryDep) -> dict[str, Any]:
    """A tenant's budget, alert levels, request-log setting, and spend this month."""
    found = await resolve_tenant(registry, tenant)
    return _account(billing, found.tenant_id, found.name)


@admin_router.patch("/tenants/{tenant}/billing")
async def update_account(
    tenant: str, body: AccountUpdate, billing: BillingDep, registry: RegistryDep
) -> dict[str, Any]:
    """Set a tenant's budget, alert levels or request log (effective on this gateway at once,
    on the others within a refresh interval)."""
    found = await resolve_tenant(registry, tenant)
    account = billing.budgets.account(found.tenant_id)
    changes: dict[str, Any] = {}
    fields = body.model_fields_set
    if "monthly_budget" in fields:
        changes["monthly_budget_micros"] = (
            None if body.monthly_budget is None else _micros(body.monthly_budget, "monthly_budget")
        )
    if "alert_thresholds_pct" in fields and body.alert_thresholds_pct is not None:
        changes["alert_thresholds_pct"] = tuple(sorted(set(body.alert_thresholds_pct)))
    if "request_log" in fields and body.request_log is not None:
        changes["request_log"] = body.request_log
    if "request_log_retention_s" in fields and body.request_log_retention_s is not None:
        changes["request_log_retention_s"] = body.request_log_retention_s
    values = {
        "monthly_budget_micros": account.monthly_budget_micros,
        "alert_thresholds_pct": account.alert_thresholds_pct,
        "request_log": account.request_log,
        "request_log_retention_s": account.request_log_retention_s,
        **changes,
    }
    await _ledger(billing.put_account(AccountSettings(found.tenant_id, **values)))
    return _account(billing, found.tenant_id, found.name)


@admin_router.get("/billing/budgets")
async def list_budgets(billing: BillingDep) -> dict[str, Any]:
    """Every tenant with a budget or spend this month, with its standing."""
    return {"object": "list", "data": [_budget(status) for status in billing.budget_statuses()]}


@admin_router.get("/billing/alerts")
async def list_alerts(
    billing: BillingDep, registry: RegistryDep, tenant: str | None = None, since: str | None = None
) -> dict[str, Any]:
    """Budget alerts fired since ``since`` (default: the start of this month)."""
    tenant_id = (await resolve_tenant(registry, tenant)).tenant_id if tenant else None
    since_us = month_of(now_us()).start_us if since is None else _instant(since, "since")
    alerts = await _ledger(billing.alerts(tenant_id, since_us))
    return {
        "object": "list",
        "data": [
            {
                "tenant_id": a.tenant_id,
                "month": a.month,
                "threshold_pct": a.threshold_pct,
                "spend": format_micros(a.spend_micros),
                "budget": format_micros(a.budget_micros),
                "fired_at": format_unix_us(a.fired_at_us),
            }
            for a in alerts
        ],
    }


@admin_router.get("/billing/cost")
async def measured_cost(billing: BillingDep) -> dict[str, Any]:
    """Measured cost per 1k tokens per deployment and model version over sliding windows, on
    a busy-time and a provisioned basis, next to what was charged (margin)."""
    if billing.cost_meter is None:
        raise NotFoundError("No cost meter: set TANDEM_WORKER_COST_PER_HOUR to measure cost.")
    return {"currency": billing.config.currency, **figures_to_json(billing.cost_meter.snapshot())}


@admin_router.get("/tenants/{tenant}/request-log")
async def request_log(
    tenant: str,
    billing: BillingDep,
    registry: RegistryDep,
    from_: Annotated[str, Query(alias="from")],
    to: str,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    """A tenant's kept prompts and outputs (PII scrubbed) created in ``[from, to)``."""
    found = await resolve_tenant(registry, tenant)
    period = _period(from_, to)
    entries = await _ledger(
        billing.request_log(found.tenant_id, period.start_us, period.end_us, limit)
    )
    return {
        "object": "list",
        "data": [
            {
                "request_id": e.request_id,
                "created_at": format_unix_us(e.created_at_us),
                "expires_at": format_unix_us(e.expires_at_us),
                "prompt": e.prompt,
                "output": e.output,
            }
            for e in entries
        ],
    }


@tenant_router.get("/v1/usage")
async def own_usage(
    http_request: HttpRequest,
    services: AdminDep,
    from_: Annotated[str | None, Query(alias="from")] = None,
    to: str | None = None,
    kind: ExportKind = ExportKind.DAILY,
    fmt: Annotated[str, Query(alias="format", pattern="^(json|csv|jsonl|cloudevents)$")] = "json",
) -> Response:
    """The caller's own usage (its key's tenant only): daily summaries with totals and the
    budget as JSON (default: this month), or any export kind and format."""
    caller = await services.authenticate(http_request.headers.get("authorization"))
    billing = await get_billing(services)
    tenant_id = caller.tenant.tenant_id
    if from_ is None and to is None:
        period = month_of(now_us())
    elif from_ is None or to is None:
        raise InvalidRequestError("Give both from and to, or neither (this month).", param="from")
    else:
        period = _period(from_, to)
    if fmt != "json":
        return await _export(billing, period, kind, ExportFormat(fmt), tenant_id)
    days = daily_summaries(await _records(billing, period, tenant_id))
    return _json_response(
        {
            "object": "usage",
            "tenant_id": tenant_id,
            "from": format_unix_us(period.start_us),
            "to": format_unix_us(period.end_us),
            "currency": billing.config.currency,
            "total": {
                "requests": sum(d.num_requests for d in days),
                "prompt_tokens": sum(d.prompt_tokens for d in days),
                "completion_tokens": sum(d.completion_tokens for d in days),
                "cached_tokens": sum(d.cached_tokens for d in days),
                "cost": format_micros(sum(d.cost_micros for d in days)),
            },
            "budget": _budget(billing.budget_status(tenant_id)),
            "data": [
                {
                    "day": d.day,
                    "model": d.model,
                    "model_version": d.model_version,
                    "requests": d.num_requests,
                    "prompt_tokens": d.prompt_tokens,
                    "completion_tokens": d.completion_tokens,
                    "cached_tokens": d.cached_tokens,
                    "cost": format_micros(d.cost_micros),
                }
                for d in days
            ],
        }
    )


async def _export(
    billing: Billing, period: Period, kind: ExportKind, fmt: ExportFormat, tenant_id: str | None
) -> StreamingResponse:
    await _ledger(billing.flush())
    query = UsageQuery(period.start_us, period.end_us, tenant_id)
    # A sync iterator: Starlette runs it in its thread pool, page by page from the database.
    chunks = export(
        kind, fmt, _pages(billing, query), tenant_id=tenant_id, period=period, source=_SOURCE
    )
    name = filename(kind, fmt, tenant_id, period)
    return StreamingResponse(
        chunks,
        media_type=content_type(fmt),
        headers={"content-disposition": f'attachment; filename="{name}"'},
    )


def _pages(billing: Billing, query: UsageQuery) -> Iterator[UsageRecord]:
    for page in billing.usage_pages_sync(query):
        yield from page


async def _records(billing: Billing, period: Period, tenant_id: str) -> list[UsageRecord]:
    records: list[UsageRecord] = []
    try:
        async for page in billing.usage(UsageQuery(period.start_us, period.end_us, tenant_id)):
            records.extend(page)
    except LedgerUnavailableError as exc:
        raise _unavailable() from exc
    return records


def _period(from_text: str, to_text: str) -> Period:
    try:
        return parse_period(from_text, to_text)
    except PeriodError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from exc


def _instant(text: str, param: str = "effective_from") -> int:
    try:
        return parse_instant(text, param)
    except PeriodError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from exc


def _micros(value: str | float, param: str) -> int:
    try:
        amount = Decimal(str(value))
    except InvalidOperation as exc:
        raise InvalidRequestError(f"{param} must be a decimal string such as \"250.00\"",
                                  param=param) from exc  # fmt: skip
    micros = amount * MICROS_PER_UNIT
    if not amount.is_finite() or amount < 0 or micros != micros.to_integral_value():
        raise InvalidRequestError(
            f"{param} must be a non-negative amount with at most 6 decimal places", param=param
        )
    return int(micros)


async def _ledger(operation: Any) -> Any:
    try:
        return await operation
    except LedgerUnavailableError as exc:
        raise _unavailable() from exc


def _unavailable() -> StoreUnavailableError:
    return StoreUnavailableError(
        "The billing ledger database is unavailable; records are kept and written when it is "
        "back. Retry shortly.",
        code="ledger_unavailable",
        retry_after_s=5.0,
    )


def _card(card: PriceCard) -> dict[str, Any]:
    return {
        "model_version": card.model_version,
        "effective_from": format_unix_us(card.effective_from_us),
        "input_per_1k": format(card.input_per_1k, "f"),
        "output_per_1k": format(card.output_per_1k, "f"),
        "cached_input_per_1k": format(card.cached_input_per_1k, "f"),
        "currency": card.currency,
    }


def _budget(status: BudgetStatus) -> dict[str, Any]:
    ratio = status.used_ratio
    return {
        "tenant_id": status.tenant_id,
        "month": status.month,
        "budget": None if status.budget_micros is None else format_micros(status.budget_micros),
        "spend": format_micros(status.spend_micros),
        "used_ratio": None if ratio is None else round(ratio, 6),
        "exhausted": status.exhausted,
    }


def _account(billing: Billing, tenant_id: str, name: str) -> dict[str, Any]:
    account = billing.budgets.account(tenant_id)
    budget = account.monthly_budget_micros
    return {
        "tenant_id": tenant_id,
        "name": name,
        "currency": billing.config.currency,
        "monthly_budget": None if budget is None else format_micros(budget),
        "alert_thresholds_pct": list(account.alert_thresholds_pct),
        "request_log": account.request_log,
        "request_log_retention_s": account.request_log_retention_s,
        "this_month": _budget(billing.budget_status(tenant_id)),
    }


def _json_response(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")

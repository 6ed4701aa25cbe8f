"""Billing through the gateway: every admitted request lands in the ledger once, budgets
refuse at admission, exports are byte-stable, a tenant reads only its own usage, and kept
request logs are scrubbed. Real uvicorn, the official ``openai`` client, the fake engine."""

from __future__ import annotations

import asyncio
import csv
import io
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.gateway.conftest import MODEL, FakeStack

pytestmark = pytest.mark.asyncio

CHAT = [{"role": "user", "content": "tell me about the weather today please"}]


def _period() -> dict[str, str]:
    today = datetime.now(UTC).date()
    return {"from": str(today - timedelta(days=1)), "to": str(today + timedelta(days=2))}


async def _export(stack: FakeStack, **params: str) -> httpx.Response:
    response = await stack.admin.get("/admin/v1/billing/export", params={**_period(), **params})
    assert response.status_code == 200, response.text
    return response


async def _rows(stack: FakeStack, **params: str) -> list[dict[str, str]]:
    response = await _export(stack, kind="requests", format="csv", **params)
    return list(csv.DictReader(io.StringIO(response.text)))


async def _price(stack: FakeStack, input_per_1k: str = "1", output_per_1k: str = "2") -> None:
    created = await stack.admin.post(
        "/admin/v1/billing/prices",
        json={"model_version": MODEL, "input_per_1k": input_per_1k, "output_per_1k": output_per_1k},
    )
    assert created.status_code == 201, created.text


async def test_every_request_is_recorded_once_with_the_engine_usage(fake_stack: FakeStack) -> None:
    await _price(fake_stack)
    answer = await fake_stack.client.chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    stream = await fake_stack.client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    )
    streamed_usage = None
    async for chunk in stream:
        streamed_usage = chunk.usage or streamed_usage
    rows = await _rows(fake_stack)
    assert len(rows) == 2
    by_id = {row["request_id"]: row for row in rows}
    assert answer.usage is not None and streamed_usage is not None
    for row, usage in zip(rows, (answer.usage, streamed_usage), strict=True):
        assert row["status"] == "completed"
        assert row["finish_reason"] == "stop"
        assert row["path"] == "disaggregated"
        assert int(row["prompt_tokens"]) == usage.prompt_tokens
        assert int(row["completion_tokens"]) == usage.completion_tokens
        # $1 per 1k input, $2 per 1k output: (p + 2c) / 1000 dollars = (p + 2c) * 1000 micros.
        expected = (usage.prompt_tokens + 2 * usage.completion_tokens) * 1000
        assert int(row["cost_micros"]) == expected
        assert row["model_version"] == MODEL
        assert row["key_id"]
    assert len(by_id) == 2


async def test_an_idempotent_request_is_billed_once_and_its_replay_not_at_all(
    fake_stack: FakeStack,
) -> None:
    headers = {"Idempotency-Key": "order-42"}
    first = await fake_stack.client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        extra_headers=headers,  # type: ignore[arg-type]
    )
    replay = await fake_stack.client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=CHAT,
        extra_headers=headers,  # type: ignore[arg-type]
    )
    assert replay.headers.get("idempotent-replayed") == "true"
    assert replay.parse().id == first.id
    rows = await _rows(fake_stack)
    assert len(rows) == 1
    assert rows[0]["record_id"].startswith("idem-")


async def test_a_spent_budget_refuses_with_insufficient_quota_and_fires_alerts(
    fake_stack: FakeStack,
) -> None:
    await _price(fake_stack, input_per_1k="10", output_per_1k="10")
    answer = await fake_stack.client.chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    assert answer.usage is not None
    one_request = answer.usage.total_tokens * 10_000  # micros: $10 per 1k tokens
    # Room for exactly two more requests like it: the third is refused.
    budget_micros = 3 * one_request
    updated = await fake_stack.admin.patch(
        "/admin/v1/tenants/default/billing",
        json={"monthly_budget": f"{budget_micros / 1_000_000:.6f}"},
    )
    assert updated.status_code == 200, updated.text
    assert updated.json()["this_month"]["spend"] == f"{one_request / 1_000_000:.6f}"
    for _ in range(2):
        await fake_stack.client.chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    with pytest.raises(openai.RateLimitError) as refused:
        await fake_stack.client.chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    error = refused.value
    assert error.code == "insufficient_quota"
    assert error.response.headers["x-should-retry"] == "false"
    assert "budget" in error.message
    assert len(await _rows(fake_stack)) == 3  # the refused request was not billed
    fired = await _wait_for_alerts(fake_stack, 3)
    assert [alert["threshold_pct"] for alert in fired] == [50, 80, 100]
    metrics = (await fake_stack.admin.get("/metrics")).text
    assert 'tandem_budget_used_ratio{tenant_id="' in metrics
    # Raising the budget lets the tenant in again at once.
    raised = await fake_stack.admin.patch(
        "/admin/v1/tenants/default/billing", json={"monthly_budget": "1000"}
    )
    assert raised.status_code == 200
    await fake_stack.client.chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]


async def _wait_for_alerts(stack: FakeStack, count: int) -> list[dict[str, Any]]:
    """Alerts are stored by the billing refresher, off the request path: poll for them."""
    found: list[dict[str, Any]] = []
    for _ in range(100):
        found = (await stack.admin.get("/admin/v1/billing/alerts")).json()["data"]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"alerts never reached {count}: {found}")


async def test_exports_are_byte_stable_and_add_up(fake_stack: FakeStack) -> None:
    await _price(fake_stack)
    for _ in range(3):
        await fake_stack.client.chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    for kind in ("requests", "daily", "invoice"):
        for fmt in ("csv", "jsonl", "cloudevents"):
            first = await _export(fake_stack, kind=kind, format=fmt)
            second = await _export(fake_stack, kind=kind, format=fmt)
            assert first.content == second.content, (kind, fmt)
            assert first.content
    rows = await _rows(fake_stack)
    daily = await _export(fake_stack, kind="daily", format="csv")
    day_rows = list(csv.DictReader(io.StringIO(daily.text)))
    assert sum(int(r["cost_micros"]) for r in day_rows) == sum(int(r["cost_micros"]) for r in rows)
    assert sum(int(r["num_requests"]) for r in day_rows) == 3


async def test_a_tenant_reads_only_its_own_usage(fake_stack: FakeStack) -> None:
    other_key = await fake_stack.new_tenant("other")
    async with fake_stack.client_for(other_key) as other:
        await other.chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    await fake_stack.client.chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    await fake_stack.client.chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    async with httpx.AsyncClient(base_url=fake_stack.base_url) as http:
        mine = await http.get("/v1/usage", headers=fake_stack.auth_headers)
        theirs = await http.get("/v1/usage", headers={"Authorization": f"Bearer {other_key}"})
        rows = await http.get(
            "/v1/usage",
            params={**_period(), "kind": "requests", "format": "csv"},
            headers={"Authorization": f"Bearer {other_key}"},
        )
        anonymous = await http.get("/v1/usage")
    assert mine.status_code == 200, mine.text
    assert mine.json()["total"]["requests"] == 2
    assert theirs.json()["total"]["requests"] == 1
    assert mine.json()["tenant_id"] != theirs.json()["tenant_id"]
    exported = list(csv.DictReader(io.StringIO(rows.text)))
    assert {row["tenant_id"] for row in exported} == {theirs.json()["tenant_id"]}
    assert anonymous.status_code == 401


async def test_the_request_log_keeps_scrubbed_prompts_only_when_enabled(
    fake_stack: FakeStack,
) -> None:
    secret: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "mail me at jane.doe@example.com about it"}
    ]
    await fake_stack.client.chat.completions.create(model=MODEL, messages=secret)
    enabled = await fake_stack.admin.patch(
        "/admin/v1/tenants/default/billing",
        json={"request_log": True, "request_log_retention_s": 3600},
    )
    assert enabled.status_code == 200, enabled.text
    await fake_stack.client.chat.completions.create(model=MODEL, messages=secret)
    # A stream lets go of its prompt as it decodes, unless its tenant's log keeps it.
    stream = await fake_stack.client.chat.completions.create(
        model=MODEL, messages=secret, stream=True
    )
    async for _ in stream:
        pass
    kept = await fake_stack.admin.get("/admin/v1/tenants/default/request-log", params=_period())
    assert kept.status_code == 200, kept.text
    entries = kept.json()["data"]
    assert len(entries) == 2  # the request before it was enabled is not kept
    for entry in entries:
        assert "jane.doe@example.com" not in entry["prompt"]
        assert "[REDACTED:email]" in entry["prompt"]
        assert entry["output"]


async def test_price_cards_are_append_only_and_never_backdated(fake_stack: FakeStack) -> None:
    past = await fake_stack.admin.post(
        "/admin/v1/billing/prices",
        json={"model_version": MODEL, "input_per_1k": "1", "output_per_1k": "1",
              "effective_from": "2020-01-01T00:00:00Z"},
    )  # fmt: skip
    assert past.status_code == 400
    assert "past" in past.json()["error"]["message"]
    bad = await fake_stack.admin.post(
        "/admin/v1/billing/prices",
        json={"model_version": MODEL, "input_per_1k": "cheap", "output_per_1k": "1"},
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["message"].startswith("input_per_1k")
    later = "2030-01-01T00:00:00Z"
    body = {"model_version": MODEL, "input_per_1k": "0.0000375", "output_per_1k": "1",
            "effective_from": later}  # fmt: skip
    assert (await fake_stack.admin.post("/admin/v1/billing/prices", json=body)).status_code == 201
    again = await fake_stack.admin.post("/admin/v1/billing/prices", json=body)
    assert again.status_code == 409
    listed = (await fake_stack.admin.get("/admin/v1/billing/prices")).json()["data"]
    assert listed == [
        {"model_version": MODEL, "effective_from": "2030-01-01T00:00:00.000000Z",
         "input_per_1k": "0.0000375", "output_per_1k": "1", "cached_input_per_1k": "0.0000375",
         "currency": "USD"}
    ]  # fmt: skip


async def test_measured_cost_and_ledger_metrics_are_exposed(fake_stack: FakeStack) -> None:
    await fake_stack.client.chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    cost = await fake_stack.admin.get("/admin/v1/billing/cost")
    assert cost.status_code == 200, cost.text
    assert cost.json()["currency"] == "USD"
    await _rows(fake_stack)  # flushes
    metrics = (await fake_stack.admin.get("/metrics")).text
    assert 'tandem_ledger_records_total{outcome="written"} 1.0' in metrics
    assert "tandem_ledger_database_up 1.0" in metrics
    assert "tandem_host_memory_used_bytes" in metrics

"""The ledger's database goes down under load and the gateway restarts before it is back:
every request is still billed exactly once (PostgreSQL stopped for real; spool on disk)."""

from __future__ import annotations

import asyncio
import csv
import io
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from billing.service import BillingConfig
from tests.gateway.conftest import MODEL, FakeStack, make_fake_stack
from tests.postgres_server import PostgresServer

pytestmark = pytest.mark.asyncio

CHAT = [{"role": "user", "content": "count to three"}]


async def _send(stack: FakeStack, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        raw = await stack.client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
        )
        ids.append(raw.headers["x-request-id"])
    return ids


async def _export_ids(stack: FakeStack) -> list[str]:
    today = datetime.now(UTC).date()
    response = await stack.admin.get(
        "/admin/v1/billing/export",
        params={"from": str(today - timedelta(days=1)), "to": str(today + timedelta(days=2))},
    )
    assert response.status_code == 200, response.text
    return [row["request_id"] for row in csv.DictReader(io.StringIO(response.text))]


async def test_outage_and_restart_lose_and_double_nothing(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    url = postgres_server.create_database(f"outage_{uuid.uuid4().hex[:8]}")
    billing = BillingConfig(
        sqlite_path=tmp_path / "unused.db",
        spool_dir=tmp_path / "spool",
        database_url=url,
        refresh_interval_s=0.1,
        flush_interval_s=0.05,
    )
    sent: list[str] = []
    try:
        async with make_fake_stack(gateway={"billing": billing}) as stack:
            sent += await _send(stack, 5)
            assert len(await _export_ids(stack)) == 5
            postgres_server.stop()
            sent += await _send(stack, 10)  # answered normally: billing never blocks serving
            await asyncio.sleep(0.3)  # the writer has tried, failed and spooled
            metrics = (await stack.admin.get("/metrics")).text
            assert "tandem_ledger_database_up 0.0" in metrics
            export = await stack.admin.get(
                "/admin/v1/billing/export", params={"from": "2026-01-01", "to": "2099-01-01"}
            )
            assert export.status_code == 503
            assert export.json()["error"]["code"] == "ledger_unavailable"
        # The gateway stopped with the database still down: the records stay spooled.
        assert list((tmp_path / "spool").glob("*.jsonl"))
    finally:
        postgres_server.start()
    # A new gateway on the same state replays the spool into the database that is back.
    async with make_fake_stack(gateway={"billing": billing}) as stack:
        sent += await _send(stack, 2)
        exported = await _export_ids(stack)
    assert sorted(exported) == sorted(sent)
    assert len(exported) == len(set(exported)) == 17

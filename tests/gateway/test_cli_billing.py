"""``tandem billing`` against a real gateway (fake engines): exports, prices, budgets, cost."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.gateway.conftest import MODEL, FakeStack, run_cli

QUESTION = [{"role": "user", "content": "hello there"}]


async def _tandem(
    capsys: pytest.CaptureFixture[str], stack: FakeStack, *argv: str
) -> tuple[int, str, str]:
    return await run_cli(capsys, stack, "billing", *argv)


def _dates() -> tuple[str, str]:
    today = datetime.now(UTC).date()
    return str(today), str(today + timedelta(days=1))


async def test_prices_budget_and_a_byte_stable_export_file(
    fake_stack: FakeStack, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = await _tandem(
        capsys, fake_stack, "prices", "set", MODEL, "--input", "0.5", "--output", "1.5"
    )
    assert code == 0, out
    assert json.loads(out)["output_per_1k"] == "1.5"
    code, out, _ = await _tandem(capsys, fake_stack, "prices", "list")
    assert [card["model_version"] for card in json.loads(out)["data"]] == [MODEL]

    for _ in range(2):
        await fake_stack.client.chat.completions.create(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]

    code, out, _ = await _tandem(
        capsys, fake_stack, "budget", "default", "--monthly", "25", "--alerts", "80,50"
    )
    assert code == 0, out
    account = json.loads(out)
    assert account["monthly_budget"] == "25.000000"
    assert account["alert_thresholds_pct"] == [50, 80]

    start, end = _dates()
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    for target in (first, second):
        code, _, err = await _tandem(
            capsys, fake_stack, "export", "--from", start, "--to", end, "--tenant", "default",
            "--kind", "requests", "--out", str(target),
        )  # fmt: skip
        assert code == 0, err
    assert first.read_bytes() == second.read_bytes()
    lines = first.read_text().splitlines()
    assert lines[0].startswith("record_id,request_id,tenant_id")
    assert len(lines) == 3

    code, out, _ = await _tandem(
        capsys, fake_stack, "export", "--from", start, "--to", end, "--kind", "invoice",
        "--format", "jsonl",
    )  # fmt: skip
    assert code == 0
    invoice = json.loads(out.splitlines()[0])
    assert invoice["num_requests"] == 2

    code, out, _ = await _tandem(capsys, fake_stack, "cost")
    assert code == 0 and json.loads(out)["currency"] == "USD"


async def test_a_bad_period_is_an_error_that_says_what_to_send(
    fake_stack: FakeStack, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = await _tandem(
        capsys, fake_stack, "export", "--from", "yesterday", "--to", "2026-12-01"
    )
    assert code == 1
    assert "400" in err and "from" in err

"""``tandem planner status`` against a gateway planning in a dry run (fake engines), and its
table from a status alone."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from gateway.cli.planner import render
from tests.gateway.conftest import MODEL, FakeStack, run_cli
from tests.gateway.test_planner_api import decided, planned_stack, traffic_until


async def test_status_prints_each_pool_and_its_decision(capsys: pytest.CaptureFixture[str]) -> None:
    async with planned_stack() as stack:
        await traffic_until(stack, decided)
        code, out, err = await run_cli(capsys, stack, "planner", "status")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].startswith("planner: dry-run, every 0.2 s; targets TTFT 1 s, ITL 1 s")
        [decode] = [line for line in lines if "decode" in line]
        assert "1 -> 8" in decode and "1-8" in decode  # the change, the limits
        [prefill] = [line for line in lines if "prefill" in line]
        assert MODEL in prefill and "0-8" in prefill

        code, out, _ = await run_cli(capsys, stack, "planner", "status", "--json")
        assert code == 0
        assert json.loads(out)["versions"][0]["pools"]["decode"]["decisions"][0]["desired"] == 8


async def test_status_of_a_gateway_without_a_planner(
    capsys: pytest.CaptureFixture[str], fake_stack: FakeStack
) -> None:
    code, out, _ = await run_cli(capsys, fake_stack, "planner", "status")
    assert code == 0
    assert out.startswith("planner: off")


def test_a_refusal_and_a_lease_held_elsewhere_are_said() -> None:
    change = {"at": 0.0, "current": 2, "recommended": 5, "desired": 5, "reason": "load needs 5"}
    pools = {
        "prefill": {
            "ready": 2, "starting": 0, "desired": 2, "min_replicas": 0, "max_replicas": 8,
            "last": {**change, "desired": 2, "reason": "the load needs what runs", "error": None},
            "decisions": [],
        },
        "decode": {
            "ready": 2, "starting": 0, "desired": 5, "min_replicas": 1, "max_replicas": 8,
            "last": {**change, "error": "HTTP 403 Forbidden"},
            "decisions": [{**change, "error": "HTTP 403 Forbidden"}],
        },
    }  # fmt: skip
    status = {
        "mode": "kubernetes", "interval_s": 30.0, "profile": "smol@0",
        "targets": {"ttft_s": 1.0, "itl_s": 0.1, "headroom": 0.8},
        "lease": {"name": "planner", "holder": "gw-1", "held": True},
        "versions": [{"version": "smol@1", "alias": "smol", "error": "decode: HTTP 403",
                      "pools": pools}],
    }  # fmt: skip
    text = _text(status)
    assert "holds: the load needs what runs" in text
    assert "1970-01-01 00:00:00Z 2 -> 5 (refused: HTTP 403 Forbidden)" in text
    assert "smol@1: the latest step failed: decode: HTTP 403" in text
    elsewhere = _text({**status, "lease": {"name": "planner", "holder": "gw-2", "held": False}})
    assert "does not hold the planner's lease" in elsewhere and "smol@1" not in elsewhere


def _text(status: dict[str, object]) -> str:
    console = Console(file=io.StringIO(), width=200)
    for line in render(status):
        console.print(line)
    return console.file.getvalue()  # type: ignore[attr-defined,no-any-return]

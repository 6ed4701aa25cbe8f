"""The planner in a running gateway (fake engines): a dry run over real traffic decides, and
shows it in ``GET /admin/v1/planner``, on ``/metrics`` and in the audit log; off, the status
says so."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from gateway.planning import PlannerConfig
from planner.profile import DecodePoint, PrefillPoint, Profile
from planner.replicas import Targets
from tests.gateway.conftest import MODEL, FakeStack, make_fake_stack

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
# A worker that sustains almost nothing: one stream at 2 s a token, against a 1 s target. Any
# traffic (at least one request an interval: 5 requests/s of 8 tokens) needs 50 decode workers,
# capped at the 8 of the policy: every step that sees traffic asks for the same 1 -> 8.
TINY = Profile(MODEL, prefill=(PrefillPoint(16, 10.0),), decode=(DecodePoint(1, 2.0),))
DRY_RUN = PlannerConfig(
    mode="dry-run", profile=TINY, interval_s=0.2, targets=Targets(ttft_s=1.0, itl_s=1.0)
)


@asynccontextmanager
async def planned_stack() -> AsyncIterator[FakeStack]:
    """A gateway (one prefill, one decode fake engine) planning its pools in a dry run."""
    async with make_fake_stack(gateway={"planner": DRY_RUN}) as stack:
        yield stack


def decided(status: dict[str, Any], times: int = 1) -> bool:
    """Whether the planner changed the decode pool (in a dry run: would have), and has stepped
    ``times`` intervals or more since its first change (a change asked again is listed once)."""
    versions = status["versions"]
    if not versions or not versions[0]["pools"]["decode"]["decisions"]:
        return False
    pool = versions[0]["pools"]["decode"]
    since_s = pool["last"]["at"] - pool["decisions"][-1]["at"]
    return since_s >= (times - 1) * status["interval_s"] * 0.99


async def traffic_until(
    stack: FakeStack, condition: Callable[[dict[str, Any]], bool], timeout_s: float = 10.0
) -> dict[str, Any]:
    """Chat requests through the gateway until the planner's status meets ``condition``;
    that status."""
    deadline = time.monotonic() + timeout_s
    while True:
        await stack.client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8)
        response = await stack.admin.get("/admin/v1/planner")
        assert response.status_code == 200, response.text
        status: dict[str, Any] = response.json()
        if condition(status):
            return status
        assert time.monotonic() < deadline, f"the planner did not decide in time: {status}"


async def test_a_dry_run_decides_on_live_traffic_and_shows_it_everywhere() -> None:
    async with planned_stack() as stack:
        # Three steps asking for the same change: counted and audited once.
        status = await traffic_until(stack, lambda status: decided(status, times=3))
        assert (status["mode"], status["interval_s"], status["profile"]) == ("dry-run", 0.2, MODEL)
        assert status["targets"] == {"ttft_s": 1.0, "itl_s": 1.0, "headroom": 0.8, "kv_usage": 0.9}
        assert status["lease"] is None  # a dry run plans the pools of each gateway
        [version] = status["versions"]
        assert version["version"] == MODEL and version["error"] is None
        decode = version["pools"]["decode"]
        assert (decode["ready"], decode["starting"]) == (1, 0)  # the fake engine, healthy
        assert (decode["min_replicas"], decode["max_replicas"]) == (1, 8)
        change = decode["decisions"][0]
        assert (change["current"], change["desired"], change["error"]) == (1, 8, None)
        assert change["reason"] == "load needs 8"
        assert abs(change["at"] - time.time()) < 30

        async with httpx.AsyncClient() as client:
            scraped = await client.get(f"{stack.base_url}/metrics")
        samples = {
            (sample.name, sample.labels.get("pool"), sample.labels.get("direction")): sample
            for family in text_string_to_metric_families(scraped.text)
            for sample in family.samples
            if sample.name.startswith("tandem_planner_")
        }
        desired = samples["tandem_planner_desired_replicas", "decode", None]
        assert desired.labels["version"] == MODEL
        assert desired.value in (1, 8)  # 1: a step that saw no traffic holds the pool
        assert samples["tandem_planner_current_replicas", "decode", None].value == 1
        assert samples["tandem_planner_decisions_total", "decode", "up"].value == 1  # said once

        audit = (await stack.admin.get("/admin/v1/audit", params={"alias": MODEL})).json()
        [entry] = [
            e for e in audit["data"] if e["actor"] == "planner" and e["after"]["pool"] == "decode"
        ]
        assert (entry["action"], entry["subject"]) == ("pool.scale", MODEL)
        assert entry["before"] == {"pool": "decode", "replicas": 1}
        after = entry["after"]
        assert (after["pool"], after["replicas"], after["dry_run"]) == ("decode", 8, True)
        assert after["recommended"] >= 50  # before the policy's limit
        assert entry["reason"] == "load needs 8"


async def test_off_the_status_says_so_to_admins_only(fake_stack: FakeStack) -> None:
    response = await fake_stack.admin.get("/admin/v1/planner")
    assert response.status_code == 200
    assert response.json() == {"mode": "off", "versions": []}
    async with httpx.AsyncClient(base_url=fake_stack.base_url) as anonymous:
        assert (await anonymous.get("/admin/v1/planner")).status_code == 401

"""Runs end to end: plans fixed by the seed, the load shapes as sent, the gateway's queue wait
and per-tenant figures through the real gateway over fake engines, and the rate sweep."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest

from bench.harness.arrivals import Arrival, LoadShape
from bench.harness.dataset import LengthDistribution
from bench.harness.records import RequestRecord
from bench.harness.result import RunResult
from bench.harness.run import DatasetSpec, RunConfig, build_plan, run_benchmark
from bench.harness.summary import Slos, summarize
from bench.harness.sweep import sweep
from bench.harness.workload import Target, TenantSpec
from tests.bench.tokenizer import trained_tokenizer
from tests.fakes.fake_engine import FakeEngine
from tests.gateway.conftest import MODEL, make_fake_stack


def config(**changes: object) -> RunConfig:
    base = RunConfig(
        target=Target(base_url="http://127.0.0.1:9", model=MODEL),
        shape=LoadShape(Arrival.POISSON, rate=50),
        num_requests=30,
        warmup_requests=3,
        seed=11,
        dataset=DatasetSpec(
            input_len=LengthDistribution.parse("uniform:8:40"),
            output_len=LengthDistribution.parse("fixed:6"),
        ),
        tenants=(
            TenantSpec("big", share=3),
            TenantSpec("small", share=1, output_len=LengthDistribution.parse("fixed:3")),
        ),
        check_token_counts=False,  # the fake engine's words are not the BPE's tokens
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def fingerprint(c: RunConfig) -> list[tuple[object, ...]]:
    plan = build_plan(c, trained_tokenizer())
    return [
        (p.index, p.tenant.name, p.prompt.text, p.prompt.output_tokens, p.scheduled_s, p.warmup)
        for p in plan.warmup + plan.measured
    ]


def test_a_plan_is_fixed_by_its_seed() -> None:
    assert fingerprint(config()) == fingerprint(config())
    assert fingerprint(config()) != fingerprint(config(seed=12))


def test_the_plan_follows_the_tenant_mix_and_warms_up_first() -> None:
    plan = build_plan(config(num_requests=400), trained_tokenizer())
    assert [p.index for p in plan.warmup] == [0, 1, 2] and all(p.warmup for p in plan.warmup)
    assert not any(p.warmup for p in plan.measured)
    shares = Counter(p.tenant.name for p in plan.measured)
    assert 0.65 < shares["big"] / 400 < 0.85
    assert {p.prompt.output_tokens for p in plan.measured if p.tenant.name == "small"} == {3}
    assert {p.prompt.output_tokens for p in plan.measured if p.tenant.name == "big"} == {6}
    assert plan.measured[-1].scheduled_s == pytest.approx(400 / 50)


def test_changing_one_tenant_leaves_the_others_prompts_alone() -> None:
    changed = config(
        tenants=(
            TenantSpec("big", share=3),
            TenantSpec("small", share=1, input_len=LengthDistribution.parse("fixed:90")),
        )
    )
    big = [f for f in fingerprint(config()) if f[1] == "big"]
    assert big == [f for f in fingerprint(changed) if f[1] == "big"]


def max_in_flight(records: list[RequestRecord]) -> int:
    edges = sorted(
        itertools.chain.from_iterable(
            ((r.sent_s, 1), (r.sent_s + r.elapsed_s, -1)) for r in records
        ),
        key=lambda edge: (edge[0], edge[1]),
    )
    return max(itertools.accumulate(delta for _, delta in edges))


async def test_closed_loop_keeps_exactly_the_concurrency_in_flight() -> None:
    engine = await FakeEngine(MODEL, output_tokens=5).start()
    engine.token_delay_s = 0.01
    try:
        c = config(
            target=Target(base_url=engine.base_url, model=MODEL),
            shape=LoadShape(Arrival.CONCURRENCY, max_concurrency=3),
            num_requests=15,
            warmup_requests=0,
        )
        result = await run_benchmark(c, trained_tokenizer())
    finally:
        await engine.aclose()
    assert result.summary.completed == 15
    assert max_in_flight(result.records) == 3
    assert all(r.scheduled_s is None for r in result.records)


async def test_an_open_loop_sends_on_schedule() -> None:
    engine = await FakeEngine(MODEL, output_tokens=3).start()
    try:
        c = config(target=Target(base_url=engine.base_url, model=MODEL), warmup_requests=0)
        result = await run_benchmark(c, trained_tokenizer())
    finally:
        await engine.aclose()
    lag = result.summary.metrics["schedule_lag"]
    assert lag is not None and lag.n == 30 and 0 <= lag.p50 < 20  # ms
    for record in result.records:
        assert record.scheduled_s is not None and record.sent_s >= record.scheduled_s


async def test_through_the_gateway_with_two_tenants() -> None:
    async with make_fake_stack() as stack:
        for engine in stack.decodes:
            engine.token_delay_s = 0.005
        keys = {name: await stack.new_tenant(name) for name in ("big", "small")}
        c = config(
            target=Target(base_url=stack.base_url, model=MODEL),
            tenants=(
                TenantSpec("big", share=3, api_key=keys["big"]),
                TenantSpec("small", share=1, api_key=keys["small"]),
            ),
            slos=Slos.parse(["ttft:5000"]),
        )
        progress: list[int] = []
        result = await run_benchmark(c, trained_tokenizer(), lambda r: progress.append(r.index))
    assert sorted(progress) == list(range(33))
    s = result.summary
    assert (s.sent, s.completed, s.malformed) == (30, 30, 0), s.errors_by_type
    assert s.good == 30 and s.slo_attainment == 1.0
    assert s.metrics["queue"] is not None and s.metrics["queue"].n == 30  # x-tandem-queue-ms
    assert set(result.tenants) == {"big", "small"}
    assert sum(t.sent for t in result.tenants.values()) == 30
    assert len(result.records) == 33 and sum(r.warmup for r in result.records) == 3
    assert all(r.request_id for r in result.records)
    again = RunResult.from_dict(result.to_dict())
    assert again.summary == result.summary and again.records == result.records


async def test_a_tenant_without_a_valid_key_shows_up_as_its_errors() -> None:
    async with make_fake_stack() as stack:
        key = await stack.new_tenant("good")
        c = config(
            target=Target(base_url=stack.base_url, model=MODEL),
            tenants=(TenantSpec("good", api_key=key), TenantSpec("bad", api_key="tdm-nope")),
            num_requests=12,
            warmup_requests=0,
        )
        result = await run_benchmark(c, trained_tokenizer())
    bad = result.tenants["bad"]
    assert bad.completed == 0 and bad.errors_by_status == {"401": bad.sent}
    assert result.tenants["good"].failed == 0
    assert result.summary.failed == bad.sent


def fake_point(rate: float, capacity: float) -> RunResult:
    """A run whose requests meet the SLO while the rate is under ``capacity``."""
    records = []
    for i in range(10):
        r = RequestRecord(i, "t", False, None, max_tokens=4, expected_prompt_tokens=4)
        r.status, r.ttft_s, r.e2e_s, r.elapsed_s = 200, 0.1 if rate <= capacity else 2.0, 0.2, 0.2
        r.completion_tokens = r.prompt_tokens = 4
        records.append(r)
    slos = Slos.parse(["ttft:500"])
    return RunResult(f"@{rate}", {}, summarize(records, slos), {}, records, "now")


async def test_a_sweep_stops_at_the_first_failing_rate_and_bisects() -> None:
    tried: list[float] = []

    async def run_at(point: RunConfig) -> RunResult:
        tried.append(point.shape.rate)
        assert point.shape.arrival is Arrival.POISSON
        return fake_point(point.shape.rate, capacity=5.5)

    c = config(
        slos=Slos.parse(["ttft:500"]), shape=LoadShape(Arrival.CONCURRENCY, max_concurrency=2)
    )
    result = await sweep(c, [8, 1, 2, 4, 16], run_at, refine=2)
    assert tried == [1, 2, 4, 8, 6, 5]  # 16 never: past the first failure
    assert [(p["rate"], p["meets_slos"]) for p in result.sweep] == [
        (1, True),
        (2, True),
        (4, True),
        (5, True),
        (6, False),
        (8, False),
    ]
    assert result.label == c.label and result.summary.slo_attainment == 1.0


async def test_a_sweep_needs_an_slo_and_positive_rates() -> None:
    async def never(point: RunConfig) -> RunResult:
        raise AssertionError("no run expected")

    with pytest.raises(ValueError, match="at least one SLO"):
        await sweep(config(), [1.0], never)
    with pytest.raises(ValueError, match="positive"):
        await sweep(config(slos=Slos.parse(["ttft:1"])), [0.0], never)

"""The Prometheus metrics provider (issue 22) against a real Prometheus.

Two "gateway replicas" are ``/metrics`` servers of prometheus_client registries holding the
series a gateway exposes, under the gateway's names, labels and buckets; a real ``prometheus``
(``tests/prometheus_server.py``) scrapes both every second. The module's fixture records every
test's traffic once, then waits until Prometheus has seen it and holds a few seconds of samples.

``increase()`` extrapolates to its range's edges (the provider's docstring), so counts come
back at or a little over the true ones: the assertions take the true count as the floor and
allow a quarter over, which still tells one replica's traffic from both replicas'.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from gateway.assembly import stack as stack_module
from gateway.assembly.app import GatewayConfig, RolloutsConfig
from gateway.assembly.settings import TandemSettings
from gateway.assembly.stack import Stack
from rollouts.gates import Gate, GateKind, Verdict, VersionFigures, measure
from rollouts.provider import MetricsUnavailable, WindowsProvider
from rollouts.provider_prometheus import PrometheusProvider, samples_from_buckets
from tests.fakes.model_folder import fake_version
from tests.gateway.versions_stack import make_versions_stack
from tests.prometheus_server import PrometheusServer, running_prometheus
from tests.server_process import free_port
from traffic.windows import RequestFigures, VersionWindows

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GENAI_LABELS = ("gen_ai_operation_name", "gen_ai_request_model", "tandem_version", "tandem_path",
                "tandem_tenant")  # fmt: skip
ALIAS = "smol"
BASELINE, SLOWER, TWIN, SPLIT, FAILING, IDLE = "v1", "v1-slow", "v1-twin", "v2", "v3", "v9"
VERSIONS = (BASELINE, SLOWER, TWIN, SPLIT, FAILING, IDLE)
OVER = 1.25
"""How far over the true count ``increase()``'s extrapolation may take one (module docstring)."""
MIN_SAMPLES_HELD = 7
"""Samples every series holds before the tests read: the extrapolation is then at most about
one scrape interval in six."""
LONG_S = 600.0
"""A window longer than the whole module: every request of the fixture is in it."""


class Replica:
    """One gateway replica's ``/metrics``: real prometheus_client objects, the gateway's series
    (``gateway/metrics.py``, ``billing/cost_metrics.py``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Registered first, so collected first in a scrape, and counted last for a request: a
        # scrape that shows a request's count shows every other series of it.
        self.requests = Counter(
            "tandem_requests", "Requests.", ("path", "reason", "outcome", "model", "version"),
            registry=r,
        )  # fmt: skip
        self.tokens = Counter("tandem_tokens", "Tokens.", ("kind", "model", "version"), registry=r)
        self.finish = Counter(
            "tandem_finish_reasons", "Finished requests.", ("model", "version", "finish_reason"),
            registry=r,
        )  # fmt: skip
        self.blocked = Counter(
            "tandem_moderation_blocked_requests", "Blocked.", ("model", "version"), registry=r
        )
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token", "TTFT.", GENAI_LABELS, unit="seconds",
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "gen_ai_server_time_per_output_token", "TPOT.", GENAI_LABELS, unit="seconds",
            buckets=TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "gen_ai_server_request_duration", "Duration.",
            (*GENAI_LABELS, "tandem_outcome", "error_type"), unit="seconds", registry=r,
        )  # fmt: skip
        self.cost = Gauge(
            "tandem_cost_per_1k_tokens_usd", "$/1k.",
            ("deployment", "model_version", "window", "basis"), registry=r,
        )  # fmt: skip
        self._server, self._thread = start_http_server(0, "127.0.0.1", self.registry)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self._server.server_port}"

    def touch(self, version: str) -> None:
        """Every series of ``version`` at 0 before Prometheus first scrapes: ``increase()``
        then counts every request from that first sample on."""
        for tenant in ("t1", "t2"):
            self.ttft.labels("chat", ALIAS, version, "disaggregated", tenant)
            self.tpot.labels("chat", ALIAS, version, "disaggregated", tenant)
        for outcome in ("finished", "failed"):
            self.requests.labels("disaggregated", "none", outcome, ALIAS, version)
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind, ALIAS, version)
        for reason in ("stop", "length", "none"):
            self.finish.labels(ALIAS, version, reason)
        self.blocked.labels(ALIAS, version)

    def serve(
        self,
        version: str,
        ttft_s: float,
        itl_s: float = 0.03,
        *,
        tenant: str = "t1",
        completion_tokens: int = 40,
        finish_reason: str = "stop",
        failed: bool = False,
        blocked: bool = False,
    ) -> None:
        """Record one request as the gateway does when it ends."""
        labels = ("chat", ALIAS, version, "disaggregated", tenant)
        outcome = "failed" if failed else "finished"
        if not failed:
            self.ttft.labels(*labels).observe(ttft_s)
            self.tpot.labels(*labels).observe(itl_s)
            self.tokens.labels("prompt", ALIAS, version).inc(10)
            self.tokens.labels("completion", ALIAS, version).inc(completion_tokens)
            self.finish.labels(ALIAS, version, finish_reason).inc()
        if blocked:
            self.blocked.labels(ALIAS, version).inc()
        self.duration.labels(*labels, outcome, "engine_error" if failed else "").observe(1.0)
        self.requests.labels("disaggregated", "none", outcome, ALIAS, version).inc()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@dataclass
class Fleet:
    prometheus: PrometheusServer
    replicas: tuple[Replica, Replica]


def record_traffic(a: Replica, b: Replica) -> int:
    """Every test's traffic; returns the number of requests."""
    rng = random.Random(22)
    lognormal = rng.lognormvariate
    # The latency gate's three versions, spread over both replicas: the same distribution for
    # the baseline and its twin, 1.6 times slower for the candidate.
    for version, factor in ((BASELINE, 1.0), (TWIN, 1.0), (SLOWER, 1.6)):
        for i in range(300):
            replica = a if i % 2 else b
            replica.serve(version, factor * lognormal(math.log(0.3), 0.5), lognormal(-3.5, 0.3))
    # One version split unevenly: a third on a fast replica, two thirds on a slow one.
    for _ in range(100):
        a.serve(SPLIT, 0.05, 0.03, completion_tokens=20)
    for i in range(200):
        b.serve(SPLIT, 0.3, 0.12, tenant="t2", completion_tokens=50,
                finish_reason="length" if i % 4 == 0 else "stop", blocked=i < 10)  # fmt: skip
    # One failing a fifth of its requests.
    for i in range(150):
        a.serve(FAILING, 0.3, failed=i % 5 == 0)
    # The split version's cost, as each replica's meter measured it in two windows.
    for replica, busy, provisioned, busy_60 in ((a, 0.002, 0.010, 0.5), (b, 0.004, 0.020, 0.7)):
        replica.cost.labels("default", SPLIT, "600s", "busy").set(busy)
        replica.cost.labels("default", SPLIT, "600s", "provisioned").set(provisioned)
        replica.cost.labels("default", SPLIT, "60s", "busy").set(busy_60)
    return 3 * 300 + 300 + 150


def _value(result: list[dict[str, Any]]) -> float:
    return float(result[0]["value"][1]) if result else math.nan


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    a, b = Replica(), Replica()
    try:
        for replica in (a, b):
            for version in VERSIONS:
                replica.touch(version)
        with running_prometheus([a.target, b.target], scrape_interval_s=1.0) as prometheus:
            prometheus.wait_for(
                "count(count by (instance) (tandem_requests_total))",
                lambda result: _value(result) == 2,
            )
            total = record_traffic(a, b)
            prometheus.wait_for(
                'sum(tandem_requests_total{job="tandem"})', lambda result: _value(result) == total
            )
            prometheus.wait_for(
                "min(count_over_time(tandem_requests_total[10m]))",
                lambda result: _value(result) >= MIN_SAMPLES_HELD,
            )
            yield Fleet(prometheus, (a, b))
    finally:
        a.close()
        b.close()


@pytest.fixture
async def provider(fleet: Fleet) -> AsyncIterator[PrometheusProvider]:
    provider = PrometheusProvider(fleet.prometheus.url, scrape_interval_s=1.0)
    yield provider
    await provider.aclose()


def about(value: float, true: float) -> bool:
    """``value`` is ``true`` as ``increase()`` estimates it: at least it, at most OVER x it."""
    return true <= value <= OVER * true


def near(samples: tuple[float, ...] | list[float], low: float, high: float) -> int:
    return sum(1 for sample in samples if low < sample <= high)


async def test_two_replicas_are_summed(provider: PrometheusProvider) -> None:
    figures = await provider.figures(SPLIT, LONG_S)
    assert about(figures.num_requests, 300), figures.num_requests  # 100 + 200, not either
    assert figures.num_errors == 0
    # TTFT 0.05 s on one replica, 0.3 s on the other: spread across their buckets.
    assert about(near(figures.ttft_samples, 0.04, 0.06), 100)
    assert about(near(figures.ttft_samples, 0.25, 0.5), 200)
    assert len(figures.ttft_samples) == near(figures.ttft_samples, 0.04, 0.06) + near(
        figures.ttft_samples, 0.25, 0.5
    )
    assert about(near(figures.itl_samples, 0.025, 0.05), 100)
    assert about(near(figures.itl_samples, 0.1, 0.15), 200)
    # (100 x 20 + 200 x 50) / 300 = 40; the per-replica means' mean would be 35.
    assert figures.output_tokens_mean is not None
    assert 38 <= figures.output_tokens_mean <= 42
    assert about(figures.finish_reasons["stop"], 250)
    assert about(figures.finish_reasons["length"], 50)
    assert "none" not in figures.finish_reasons  # touched at 0, never counted
    assert about(figures.moderation_blocks, 10)
    # samples() is what figures() reads, for the report's plots.
    samples = await provider.samples(SPLIT, LONG_S, "ttft")
    assert about(near(samples, 0.25, 0.5), 200)


async def test_label_matchers_narrow_every_selector(fleet: Fleet) -> None:
    other_job = PrometheusProvider(
        fleet.prometheus.url, scrape_interval_s=1.0, matchers={"job": "another-gateway"}
    )
    try:
        figures = await other_job.figures(SPLIT, LONG_S)
    finally:
        await other_job.aclose()
    assert figures.num_requests == 0
    assert figures.ttft_samples == ()
    assert figures.busy_usd_per_1k is None


async def test_an_error_rate_fails_its_gate(provider: PrometheusProvider) -> None:
    failing = await provider.figures(FAILING, LONG_S)
    baseline = await provider.figures(BASELINE, LONG_S)
    assert about(failing.num_requests, 150)
    assert failing.num_errors / failing.num_requests == pytest.approx(0.2, abs=0.02)
    assert about(len(failing.ttft_samples), 120)  # its failures had no first token
    assert baseline.num_errors == 0
    gate = Gate(GateKind.ERROR_RATE, max_ratio=1.5, min_samples=100)
    assert measure(gate, failing, baseline).verdict is Verdict.FAIL
    assert measure(gate, baseline, failing).verdict is Verdict.PASS


async def test_a_slower_candidate_fails_the_latency_gate_end_to_end(
    provider: PrometheusProvider,
) -> None:
    baseline = await provider.figures(BASELINE, LONG_S)
    slower = await provider.figures(SLOWER, LONG_S)
    twin = await provider.figures(TWIN, LONG_S)
    assert about(len(baseline.ttft_samples), 300)
    gate = Gate(GateKind.TTFT_P95, max_ratio=1.1, min_samples=100, alpha=0.01)
    failed = measure(gate, slower, baseline)
    assert failed.verdict is Verdict.FAIL, failed.detail
    assert failed.p_value is not None and failed.p_value < 0.01
    same = measure(gate, twin, baseline)
    assert same.verdict is Verdict.PASS, same.detail
    itl = Gate(GateKind.ITL_P95, max_ratio=1.1, min_samples=100, alpha=0.01)
    assert measure(itl, slower, baseline).verdict is Verdict.PASS  # only its TTFT is slower


async def test_cost_is_weighted_by_each_gateways_tokens(provider: PrometheusProvider) -> None:
    # Replica a: $0.002 busy on 3,000 tokens; b: $0.004 on 12,000: $54 / 15,000 tokens.
    figures = await provider.figures(SPLIT, LONG_S)
    assert figures.busy_usd_per_1k is not None and figures.provisioned_usd_per_1k is not None
    assert Decimal("0.0035") <= figures.busy_usd_per_1k <= Decimal("0.0037")  # the mean: 0.003
    assert Decimal("0.0175") <= figures.provisioned_usd_per_1k <= Decimal("0.0185")
    # A 100 s phase reads the meters' 60 s window (the longest within it), which has no
    # provisioned figure; a 30 s one the shortest window there is, the same.
    for window_s in (100.0, 30.0):
        short = await provider.figures(SPLIT, window_s)
        assert short.busy_usd_per_1k is not None
        assert Decimal("0.5") < short.busy_usd_per_1k < Decimal("0.7")
        assert short.provisioned_usd_per_1k is None


async def test_a_version_without_traffic_has_empty_figures(provider: PrometheusProvider) -> None:
    figures = await provider.figures(IDLE, LONG_S)
    assert figures == VersionFigures(
        num_requests=0,
        num_errors=0,
        ttft_samples=(),
        itl_samples=(),
        output_tokens_mean=None,
        finish_reasons={},
        moderation_blocks=0,
        busy_usd_per_1k=None,
        provisioned_usd_per_1k=None,
    )
    gate = Gate(GateKind.TTFT_P95, max_ratio=1.1)
    assert measure(gate, figures, figures).verdict is Verdict.INCONCLUSIVE


async def test_shadow_figures_come_from_the_gateway_or_are_unavailable(
    provider: PrometheusProvider, fleet: Fleet
) -> None:
    with pytest.raises(MetricsUnavailable, match="only measured in-gateway"):
        await provider.figures(SPLIT, LONG_S, shadow=True)
    windows = VersionWindows(bucket_s=1)
    windows.observe(SPLIT, RequestFigures(0.2, None, 0.2, None, 5, "stop", None, shadow=True))
    with_fallback = PrometheusProvider(
        fleet.prometheus.url, scrape_interval_s=1.0, shadow=WindowsProvider(windows)
    )
    try:
        shadow = await with_fallback.figures(SPLIT, 60, shadow=True)
    finally:
        await with_fallback.aclose()
    assert (shadow.num_requests, shadow.ttft_samples) == (1, (0.2,))


async def test_windows_are_at_least_four_scrapes_of_whole_seconds(
    provider: PrometheusProvider,
) -> None:
    assert provider.min_window_s == 4.0
    assert provider.range_s(0.001) == 4
    assert provider.range_s(7.2) == 8
    assert PrometheusProvider("http://p:9090").range_s(30) == 60  # 4 x the default 15 s
    for malformed in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="window_s"):
            await provider.figures(SPLIT, malformed)
        with pytest.raises(ValueError, match="window_s"):
            await provider.samples(SPLIT, malformed, "ttft")


async def test_a_failing_prometheus_is_metrics_unavailable(fleet: Fleet) -> None:
    async def failure(url: str, **options: Any) -> str:
        provider = PrometheusProvider(url, **options)
        try:
            with pytest.raises(MetricsUnavailable) as raised:
                await provider.figures(SPLIT, LONG_S)
        finally:
            await provider.aclose()
        message = str(raised.value)
        assert "tandem_" in message or "gen_ai_" in message, message  # names the query
        return message

    # Nothing listening (a stopped server, a wrong port).
    assert "ConnectError" in await failure(f"http://127.0.0.1:{free_port()}")
    # Not Prometheus: a gateway's /metrics answers any path with its text.
    replica = fleet.replicas[0].target
    assert "not a JSON object" in await failure(f"http://{replica}")
    # Prometheus under a path it does not serve.
    assert "HTTP 404" in await failure(f"{fleet.prometheus.url}/nothing-here")
    # A server that accepts the connection and never answers.
    fleet.prometheus.pause()
    try:
        assert "no answer within 0.2 s" in await failure(fleet.prometheus.url, timeout_s=0.2)
    finally:
        fleet.prometheus.resume()


def test_bucket_counts_become_samples_spread_across_each_bucket() -> None:
    # Cumulative: 2 in (0, 0.1], none in (0.1, 0.5], 3 in (0.5, 1], 1 past 1.
    buckets = {0.1: 2.0, 0.5: 2.0, 1.0: 5.0, math.inf: 6.0}
    assert samples_from_buckets(buckets, 100) == pytest.approx(
        [0.025, 0.075, 0.5 + 0.5 / 6, 0.75, 1 - 0.5 / 6, 1.0]
    )
    # increase()'s floats are rounded, cumulatively, never going down.
    assert len(samples_from_buckets({0.1: 1.4, 0.2: 1.3, math.inf: 2.6}, 100)) == 3
    # Past max_samples, the counts scale down in proportion.
    scaled = samples_from_buckets({0.1: 300.0, 0.2: 1000.0, math.inf: 1000.0}, 100)
    assert (near(scaled, 0, 0.1), near(scaled, 0.1, 0.2)) == (30, 70)
    assert samples_from_buckets({}, 100) == []


def test_the_provider_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="http"):
        PrometheusProvider("prometheus:9090")
    with pytest.raises(ValueError, match="label name"):
        PrometheusProvider("http://p:9090", matchers={"bad-name": "x"})


def test_the_setting_reaches_the_rollouts_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    built: list[GatewayConfig] = []
    monkeypatch.setattr(stack_module, "create_app", lambda config, *_, **__: built.append(config))
    version = fake_version(tmp_path)
    Stack.from_settings(TandemSettings(), version).app()
    monkeypatch.setenv("TANDEM_ROLLOUT_PROMETHEUS_URL", "http://prometheus:9090")
    Stack.from_settings(TandemSettings(), version).app()
    assert [config.rollouts.prometheus_url for config in built] == [None, "http://prometheus:9090"]
    monkeypatch.setenv("TANDEM_ROLLOUT_PROMETHEUS_URL", "prometheus:9090")
    with pytest.raises(ValueError, match="rollout_prometheus_url"):
        TandemSettings()


async def test_a_gateway_given_prometheus_judges_by_it() -> None:
    # A Prometheus that is down: the gates measure errors and the weight is held, where the
    # gateway's own windows (the default) would answer, inconclusive without traffic.
    down = f"http://127.0.0.1:{free_port()}"
    rollouts = RolloutsConfig(tick_s=0.05, lease_ttl_s=2.0, prometheus_url=down)
    async with make_versions_stack(rollouts=rollouts) as stack:
        candidate = await stack.add_version(b"v1")
        body = {
            "alias": ALIAS,
            "baseline": stack.versions[0].name,
            "candidate": candidate.name,
            "steps": [{"weight": 20, "bake_s": 30}],
            "interval_s": 0.2,
            "error_limit": 2,
            "quality": {"enabled": False},
        }
        started = await stack.admin.post("/admin/v1/rollouts", json=body)
        assert started.status_code == 201, started.text
        url = f"/admin/v1/rollouts/{started.json()['id']}"
        deadline = time.monotonic() + 20
        while (shown := (await stack.admin.get(url)).json())["status"] != "paused":
            assert time.monotonic() < deadline, shown["decisions"]
            await asyncio.sleep(0.05)
    events = [decision["event"] for decision in shown["decisions"]]
    assert events[-3:] == ["metrics_error", "metrics_error", "paused"], events

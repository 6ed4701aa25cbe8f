"""The cost meter: exact $/1k tokens from a fixed telemetry trace, sliding windows, the
Prometheus gauges and the admin JSON."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from billing.cost import CostFigure, CostMeter, WorkerCost, figures_to_json
from billing.cost_metrics import CostCollector
from billing.nvml import NvmlCollector
from billing.service import Billing, BillingConfig
from billing.telemetry import BusyBasis, TelemetryCollector
from tests.billing.fake_host import FakeClock, FakeHost
from tests.billing.fake_nvml import GIB, FakeGpu, FakeNvml

# The trace: deployment smol/v1 on two GPU workers, one 9 s tick at a time (9 s makes the
# prices come out in whole micro-dollars).
#   a: $2.50/h -> 2_500_000 micros/h -> 6250 micros per 9 s. Its engine (pid 101, child of the
#      worker's pid 100) is on GPU 0, which gives per-process SM figures (basis gpu_process).
#   b: $1.20/h -> 1_200_000 micros/h -> 3000 micros per 9 s. Pid 200 on GPU 1, which gives no
#      per-process figures: the device's utilization counts (basis gpu_device).
# Provisioned: 6250 + 3000 = 9250 micros per tick.
A_SM_PCT = [40, 80, 100, 20, 60, 0]  # ticks ending at 9, 18, 27, 36, 45, 54
#            busy cost (62.5 micros per %): 2500, 5000, 6250, 1250, 3750, 0
B_DEVICE_PCT = [50, 50, 100, 0, 10, 30]
#            busy cost (30 micros per %):   1500, 1500, 3000, 0, 300, 900
# Tokens billed (at time: tokens, charged micros; $10 per 1M tokens):
TOKENS = {5.0: (1000, 10_000), 20.0: (1000, 10_000), 40.0: (2000, 20_000), 50.0: (2000, 20_000)}


def _run_trace() -> tuple[CostMeter, TelemetryCollector]:
    clock = FakeClock(0.0)
    meter = CostMeter(
        [WorkerCost("a", "smol", "v1", 2_500_000), WorkerCost("b", "smol", "v1", 1_200_000)],
        windows_s=(18.0, 36.0, 90.0),
        clock=clock,
    )
    script = [
        [FakeGpu(processes={101: 20 * GIB}), FakeGpu(processes={200: 30 * GIB}, process_util=None)]
    ]
    script += [
        [
            FakeGpu(
                util_gpu=99, memory_used=21 * GIB, processes={101: 20 * GIB}, process_util={101: a}
            ),
            FakeGpu(util_gpu=b, memory_used=31 * GIB, processes={200: 30 * GIB}, process_util=None),
        ]
        for a, b in zip(A_SM_PCT, B_DEVICE_PCT, strict=True)
    ]
    host = FakeHost()
    host.set_process(100, children=[101])
    host.set_process(200)
    telemetry = TelemetryCollector(
        meter,
        lambda: {"a": 100, "b": 200},
        interval_s=9.0,
        host=host,
        nvml=lambda: NvmlCollector(FakeNvml(script)),
        clock=clock,
    )
    telemetry.open()  # t = 0: baselines
    for tick in range(1, 7):
        for at, (num_tokens, charged) in TOKENS.items():
            if clock.now < at <= 9.0 * tick:
                meter.observe_tokens("smol", "v1", num_tokens, charged, at=at)
        clock.now = 9.0 * tick
        workers = {w.worker: w.basis for w in telemetry.sample_once().workers}
        assert workers == {"a": BusyBasis.GPU_PROCESS, "b": BusyBasis.GPU_DEVICE}
    return meter, telemetry


def test_cost_per_1k_tokens_from_a_fixed_telemetry_trace() -> None:
    meter, _ = _run_trace()
    figures = {f.window_s: f for f in meter.snapshot()}  # now = 54
    assert list(figures) == [18.0, 36.0, 90.0]

    # 18 s window: ticks ending at 45 and 54; tokens at 40 and 50: 4000 tokens, 40_000 charged.
    #   busy a: 5.4 + 0 s = 3750 + 0 micros; b: 0.9 + 2.7 s = 300 + 900 micros -> 4950 micros
    #   provisioned: 2 x 9250 = 18_500 micros
    #   busy $/1k = 4950 / 1e6 / 4000 x 1000 = 0.0012375; provisioned 18_500 / 4e6 = 0.004625
    #   charged 40_000 / 4e6 = 0.01; margin 40_000 - 18_500 = 21_500 = 53.75 % of charged
    short = figures[18.0]
    assert (short.wall_s, short.num_tokens, short.busy_s, short.worker_s) == (18.0, 4000, 9.0, 36.0)
    assert short.busy_cost_micros == Decimal(4950)
    assert short.provisioned_cost_micros == Decimal(18_500)
    assert short.charged_micros == 40_000
    assert short.busy_usd_per_1k_tokens == Decimal("0.0012375")
    assert short.provisioned_usd_per_1k_tokens == Decimal("0.004625")
    assert short.charged_usd_per_1k_tokens == Decimal("0.01")
    assert short.margin_micros == Decimal(21_500)
    assert short.margin_ratio == Decimal("0.5375")

    # 36 s window: ticks ending at 27..54; tokens at 20, 40, 50: 5000 tokens, 50_000 charged.
    #   busy a: 6250 + 1250 + 3750 + 0 = 11_250; b: 3000 + 0 + 300 + 900 = 4200 -> 15_450
    #   busy seconds: a 9 + 1.8 + 5.4 + 0 = 16.2, b 9 + 0 + 0.9 + 2.7 = 12.6 -> 28.8
    #   provisioned 4 x 9250 = 37_000; busy $/1k = 15_450 / 5e6 = 0.00309;
    #   provisioned 37_000 / 5e6 = 0.0074; charged 0.01; margin 13_000 = 26 %
    mid = figures[36.0]
    assert (mid.wall_s, mid.num_tokens, mid.busy_s, mid.worker_s) == (36.0, 5000, 28.8, 72.0)
    assert mid.busy_usd_per_1k_tokens == Decimal("0.00309")
    assert mid.provisioned_usd_per_1k_tokens == Decimal("0.0074")
    assert mid.charged_usd_per_1k_tokens == Decimal("0.01")
    assert mid.margin_micros == Decimal(13_000)
    assert mid.margin_ratio == Decimal("0.26")

    # 90 s window, but the meter has observed 54 s (from 0, the first tick's start): all of it.
    #   6000 tokens, 60_000 charged; busy a 18_750 + b 7200 = 25_950 micros (48.6 s busy);
    #   provisioned 6 x 9250 = 55_500; busy $/1k = 25_950 / 6e6 = 0.004325;
    #   provisioned 55_500 / 6e6 = 0.00925; charged 0.01; margin 4500 = 7.5 %
    long = figures[90.0]
    assert (long.wall_s, long.num_tokens, long.busy_s, long.worker_s) == (54.0, 6000, 48.6, 108.0)
    assert long.busy_usd_per_1k_tokens == Decimal("0.004325")
    assert long.provisioned_usd_per_1k_tokens == Decimal("0.00925")
    assert long.charged_usd_per_1k_tokens == Decimal("0.01")
    assert long.margin_micros == Decimal(4500)
    assert long.margin_ratio == Decimal("0.075")


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


def test_prometheus_text_of_the_trace() -> None:
    meter, telemetry = _run_trace()
    registry = CollectorRegistry()
    registry.register(CostCollector(meter, telemetry))
    samples = _samples(generate_latest(registry).decode())
    smol = {"deployment": "smol", "model_version": "v1"}
    per_1k = "tandem_cost_per_1k_tokens_usd"
    assert samples[_key(per_1k, **smol, window="18s", basis="busy")] == 0.0012375
    assert samples[_key(per_1k, **smol, window="18s", basis="provisioned")] == 0.004625
    assert samples[_key(per_1k, **smol, window="90s", basis="busy")] == 0.004325
    assert samples[_key(per_1k, **smol, window="90s", basis="charged")] == 0.01
    assert len([k for k in samples if k[0] == per_1k]) == 9  # 3 windows x 3 bases
    assert samples[_key("tandem_cost_margin_ratio", **smol, window="36s")] == 0.26
    # The last tick: a's engine at 0 % SM, b's GPU at 30 %.
    assert samples[_key("tandem_worker_busy_ratio", worker="a", basis="gpu_process")] == 0.0
    assert samples[_key("tandem_worker_busy_ratio", worker="b", basis="gpu_device")] == (
        pytest.approx(0.3)
    )
    assert samples[_key("tandem_gpu_utilization_ratio", gpu="0", uuid="GPU-fake-0")] == 0.99
    assert samples[_key("tandem_gpu_memory_used_bytes", gpu="1")] == 31 * GIB
    assert samples[_key("tandem_gpu_power_watts", gpu="0")] == 300.0
    process_memory = "tandem_gpu_process_memory_bytes"
    assert samples[_key(process_memory, gpu="0", pid="101", worker="a")] == 20 * GIB
    assert samples[_key(process_memory, gpu="1", pid="200", worker="b")] == 30 * GIB
    assert samples[_key("tandem_host_cpu_utilization_ratio")] == 0.25
    assert samples[_key("tandem_host_memory_used_bytes")] == 8 * GIB


def test_prometheus_text_without_telemetry_or_tokens() -> None:
    meter = CostMeter(
        [WorkerCost("a", "smol", "v1", 1_000_000)], windows_s=(60.0,), clock=lambda: 10.0
    )
    meter.observe_busy("a", 1.0, 5.0, at=10.0)
    registry = CollectorRegistry()
    registry.register(CostCollector(meter))
    text = generate_latest(registry).decode()
    assert "# TYPE tandem_cost_per_1k_tokens_usd gauge" in text
    assert "tandem_cost_per_1k_tokens_usd{" not in text  # no tokens: no per-1k figure
    assert "tandem_cost_margin_ratio{" not in text  # nothing charged: no ratio
    assert "tandem_gpu_" not in text


def test_admin_json_of_the_trace() -> None:
    meter, _ = _run_trace()
    doc = json.loads(json.dumps(figures_to_json(meter.snapshot())))
    short = doc["figures"][0]
    assert (short["deployment"], short["model_version"], short["window_s"]) == ("smol", "v1", 18.0)
    assert short["usd_per_1k_tokens"] == {
        "busy": "0.0012375",
        "provisioned": "0.004625",
        "charged": "0.01",
    }
    assert Decimal(short["margin_ratio"]) == Decimal("0.5375")
    assert Decimal(short["busy_cost_micros"]) == 4950


def _meter(clock: FakeClock, windows_s: tuple[float, ...] = (10.0, 60.0)) -> CostMeter:
    return CostMeter(
        [WorkerCost("w1", "smol", "v1", 3_600_000), WorkerCost("w2", "smol", "v2", 7_200_000)],
        windows_s=windows_s,
        clock=clock,
    )


def _by_key(figures: list[CostFigure]) -> dict[tuple[str, str, float], CostFigure]:
    return {(f.deployment, f.model_version, f.window_s): f for f in figures}


def test_windows_slide_and_expire() -> None:
    clock = FakeClock(100.0)
    meter = _meter(clock)
    meter.observe_busy("w1", 5.0, 5.0)  # (95, 100]: $3.60/h = 1000 micros per s
    meter.observe_tokens("smol", "v1", 500, 7000)
    clock.now = 108.0
    meter.observe_busy("w1", 2.0, 8.0)  # (100, 108]
    meter.observe_tokens("smol", "v1", 1500, 9000)

    figures = _by_key(meter.snapshot())
    both = figures[("smol", "v1", 60.0)]
    assert (both.wall_s, both.num_tokens, both.busy_s, both.worker_s) == (13.0, 2000, 7.0, 13.0)
    assert both.busy_cost_micros == 7000
    assert both.provisioned_cost_micros == 13_000
    last = figures[("smol", "v1", 10.0)]  # (98, 108]: the first observation ended at 100
    assert (last.wall_s, last.num_tokens, last.busy_s) == (10.0, 2000, 7.0)

    clock.now = 112.0  # (102, 112]: the observations ending at 100 fell out
    last = _by_key(meter.snapshot())[("smol", "v1", 10.0)]
    assert (last.num_tokens, last.charged_micros, last.busy_s, last.worker_s) == (
        1500,
        9000,
        2.0,
        8.0,
    )
    assert last.busy_usd_per_1k_tokens == Decimal(2000) / Decimal(1_500_000)

    clock.now = 168.5  # everything is older than the largest window
    for figure in meter.snapshot():
        assert (figure.num_tokens, figure.busy_s, figure.worker_s) == (0, 0.0, 0.0)
        assert figure.busy_usd_per_1k_tokens is None
        assert figure.charged_usd_per_1k_tokens is None
        assert figure.margin_ratio is None
        assert figure.wall_s == figure.window_s  # the meter is older than every window now
    assert len(meter._buckets) == 0  # dropped, not only hidden


def test_buckets_stay_bounded_by_the_largest_window() -> None:
    clock = FakeClock()
    meter = _meter(clock, windows_s=(5.0, 30.0))
    for second in range(1, 1000):
        clock.now = float(second)
        meter.observe_busy("w1", 0.5, 1.0)
        meter.observe_tokens("smol", "v1", 10, 10)
    assert len(meter._buckets) <= 31
    figure = _by_key(meter.snapshot())[("smol", "v1", 30.0)]
    assert (figure.num_tokens, figure.busy_s, figure.worker_s) == (300, 15.0, 30.0)


def test_a_young_meter_reports_its_observed_span() -> None:
    clock = FakeClock(1000.0)
    meter = _meter(clock)
    assert {f.wall_s for f in meter.snapshot()} == {0.0}
    meter.observe_busy("w2", 1.0, 4.0, at=1000.0)  # observing since 996
    clock.now = 1003.0
    figures = _by_key(meter.snapshot())
    assert figures[("smol", "v2", 10.0)].wall_s == 7.0
    assert figures[("smol", "v2", 60.0)].wall_s == 7.0
    # $7.20/h = 2000 micros per s: 1 busy s of 4 provisioned.
    assert figures[("smol", "v2", 60.0)].busy_cost_micros == 2000
    assert figures[("smol", "v2", 60.0)].provisioned_cost_micros == 8000
    assert figures[("smol", "v1", 60.0)].worker_s == 0.0  # priced but idle: still reported


def test_late_observations_land_in_their_own_second() -> None:
    clock = FakeClock(50.0)
    meter = _meter(clock, windows_s=(10.0, 60.0))
    meter.observe_tokens("smol", "v1", 100, 1, at=50.0)
    meter.observe_tokens("smol", "v1", 10, 1, at=35.0)  # older than the newest bucket
    meter.observe_tokens("smol", "v1", 1, 1, at=45.5)
    figures = _by_key(meter.snapshot())
    assert figures[("smol", "v1", 10.0)].num_tokens == 101
    assert figures[("smol", "v1", 60.0)].num_tokens == 111
    meter.observe_tokens("smol", "v1", 1000, 1, at=-20.0)  # older than every window: dropped
    figure = _by_key(meter.snapshot())[("smol", "v1", 60.0)]
    assert (figure.num_tokens, figure.wall_s) == (111, 15.0)  # observing since 35, not -20


def test_tokens_of_an_unpriced_deployment_are_reported_at_zero_cost() -> None:
    clock = FakeClock(10.0)
    meter = _meter(clock, windows_s=(60.0,))
    meter.observe_tokens("other", "v9", 2000, 3000)
    figure = _by_key(meter.snapshot())[("other", "v9", 60.0)]
    assert figure.provisioned_usd_per_1k_tokens == 0
    assert figure.charged_usd_per_1k_tokens == Decimal("0.0015")
    assert figure.margin_ratio == 1
    assert [(f.deployment, f.model_version) for f in meter.snapshot()] == [
        ("other", "v9"),
        ("smol", "v1"),
        ("smol", "v2"),
    ]


def test_negative_margin() -> None:
    clock = FakeClock(3600.0)
    meter = _meter(clock, windows_s=(3600.0,))
    meter.observe_busy("w1", 1800.0, 3600.0)  # $3.60 provisioned, $1.80 busy
    meter.observe_tokens("smol", "v1", 1_000_000, 2_400_000)  # charged $2.40
    figure = _by_key(meter.snapshot())[("smol", "v1", 3600.0)]
    assert figure.busy_usd_per_1k_tokens == Decimal("0.0018")
    assert figure.provisioned_usd_per_1k_tokens == Decimal("0.0036")
    assert figure.margin_micros == -1_200_000
    assert figure.margin_ratio == Decimal("-0.5")


def test_caller_mistakes_are_refused() -> None:
    price = WorkerCost("w", "d", "v", 1)
    with pytest.raises(ValueError, match="priced twice"):
        CostMeter([price, price])
    with pytest.raises(ValueError, match="micros_per_hour"):
        CostMeter([WorkerCost("w", "d", "v", -1)])
    with pytest.raises(ValueError, match="windows_s"):
        CostMeter([price], windows_s=(0.0,))
    meter = CostMeter([price], clock=lambda: 0.0)
    with pytest.raises(KeyError):
        meter.observe_busy("nobody", 1.0, 1.0)
    with pytest.raises(ValueError, match="busy_s"):
        meter.observe_busy("w", 2.0, 1.0)
    with pytest.raises(ValueError, match="num_tokens"):
        meter.observe_tokens("d", "v", -1, 0)
    assert meter.has_worker("w")
    assert not meter.has_worker("nobody")


def test_a_worker_added_to_a_running_pool_is_priced_like_its_sibling(tmp_path: Path) -> None:
    meter = CostMeter([WorkerCost("decode-0", "smol", "smol@1", 2_000_000)])
    billing = Billing(
        BillingConfig(sqlite_path=tmp_path / "ledger.db", spool_dir=tmp_path / "spool"),
        cost_meter=meter,
    )
    assert billing.price_like("decode-1", "decode-0")
    assert meter.price_of("decode-1") == WorkerCost("decode-1", "smol", "smol@1", 2_000_000)
    assert not billing.price_like("decode-2", "no-such-worker")
    assert meter.price_of("decode-2") is None
    assert not Billing(billing.config).price_like("decode-3", "decode-0")  # no cost meter

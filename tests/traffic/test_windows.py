"""VersionWindows with a fake clock: counts and rates, nearest-rank quantiles, window selection,
expiry past the horizon, primary and shadow apart, the reservoir's bound and its weighting."""

from __future__ import annotations

import json
import random

import pytest

from traffic.windows import Quantiles, RequestFigures, VersionWindows


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def ok(e2e_s: float = 1.0, *, ttft_s: float | None = 0.1, shadow: bool = False) -> RequestFigures:
    return RequestFigures(
        ttft_s=ttft_s,
        itl_s=0.02,
        e2e_s=e2e_s,
        error=None,
        output_tokens=10,
        finish_reason="stop",
        moderation=None,
        shadow=shadow,
    )


def failed(kind: str, *, shadow: bool = False) -> RequestFigures:
    return RequestFigures(
        ttft_s=None,
        itl_s=None,
        e2e_s=0.001,
        error=kind,
        output_tokens=0,
        finish_reason=None,
        moderation=None,
        shadow=shadow,
    )


def test_counts_errors_tokens_reasons_and_moderation() -> None:
    windows = VersionWindows(clock=FakeClock(1000.0))
    for _ in range(6):
        windows.observe("a@1", ok())
    windows.observe("a@1", failed("engine_error"))
    windows.observe("a@1", failed("engine_error"))
    windows.observe("a@1", failed("deadline_exceeded"))
    windows.observe(
        "a@1",
        RequestFigures(0.2, None, 0.3, None, 3, "content_filter", moderation="block"),
    )
    snapshot = windows.snapshot("a@1", 60)
    assert snapshot.num_requests == 10
    assert snapshot.num_errors == 3
    assert snapshot.errors == {"deadline_exceeded": 1, "engine_error": 2}
    assert snapshot.error_rate == pytest.approx(0.3)
    assert snapshot.output_tokens == 63
    assert snapshot.finish_reasons == {"content_filter": 1, "stop": 6}
    assert snapshot.moderation == {"block": 1}
    # Latency is of the 7 successful requests only; ITL was measured on 6 of them.
    assert snapshot.e2e is not None
    assert snapshot.e2e.count == 7
    assert snapshot.itl is not None
    assert snapshot.itl.count == 6


def test_an_unknown_version_has_an_empty_snapshot() -> None:
    snapshot = VersionWindows(clock=FakeClock()).snapshot("a@9", 60)
    assert (snapshot.num_requests, snapshot.error_rate) == (0, 0.0)
    assert (snapshot.ttft, snapshot.itl, snapshot.e2e) == (None, None, None)


def test_quantiles_are_nearest_rank() -> None:
    windows = VersionWindows(clock=FakeClock())
    for value in range(100, 0, -1):
        windows.observe("a@1", ok(float(value)))
    assert windows.snapshot("a@1", 60).e2e == Quantiles(
        p50=50.0, p90=90.0, p95=95.0, p99=99.0, mean=50.5, count=100, samples=100
    )
    small = VersionWindows(clock=FakeClock())
    for value in range(1, 11):
        small.observe("a@1", ok(float(value)))
    e2e = small.snapshot("a@1", 60).e2e
    assert e2e is not None
    assert (e2e.p50, e2e.p90, e2e.p95, e2e.p99) == (5.0, 9.0, 10.0, 10.0)


def test_window_selects_the_buckets_overlapping_it() -> None:
    clock = FakeClock()
    windows = VersionWindows(horizon_s=600, bucket_s=10, clock=clock)
    for at, e2e in ((5.0, 1.0), (72.0, 2.0), (104.0, 3.0)):
        clock.now = at
        windows.observe("a@1", ok(e2e))
    clock.now = 105.0
    assert windows.snapshot("a@1", 10).num_requests == 1  # bucket [100, 110)
    recent = windows.snapshot("a@1", 30)  # back to 75: buckets [70, 80) onwards
    assert recent.num_requests == 2
    assert recent.e2e is not None
    assert recent.e2e.p50 == 2.0
    assert windows.snapshot("a@1", 105).num_requests == 3


def test_buckets_expire_past_the_horizon() -> None:
    clock = FakeClock()
    windows = VersionWindows(horizon_s=60, bucket_s=10, clock=clock)
    windows.observe("a@1", ok())
    clock.now = 30.0
    windows.observe("a@2", ok())
    clock.now = 69.9  # bucket [0, 10) still overlaps the last 60 s
    assert windows.snapshot("a@1", 60).num_requests == 1
    assert windows.versions() == ["a@1", "a@2"]
    clock.now = 70.0
    assert windows.snapshot("a@1", 60).num_requests == 0
    assert windows.versions() == ["a@2"]
    clock.now = 100.0
    assert windows.versions() == []
    with pytest.raises(ValueError, match="horizon_s"):
        windows.snapshot("a@1", 61)
    with pytest.raises(ValueError, match="window_s"):
        windows.snapshot("a@1", 0)


def test_old_buckets_are_dropped_as_a_busy_series_moves_on() -> None:
    clock = FakeClock()
    windows = VersionWindows(horizon_s=60, bucket_s=10, clock=clock)
    for second in range(0, 3600, 5):
        clock.now = float(second)
        windows.observe("a@1", ok())
    assert len(windows._series[("a@1", False)]) == 7  # the memory bound itself: 60 s + 1 bucket
    assert windows.snapshot("a@1", 60).num_requests == 14  # buckets [3530, 3540) .. [3590, 3600)


def test_shadow_traffic_is_kept_apart() -> None:
    windows = VersionWindows(clock=FakeClock())
    for _ in range(3):
        windows.observe("a@2", ok(1.0))
    windows.observe("a@2", ok(9.0, shadow=True))
    windows.observe("a@2", failed("engine_error", shadow=True))
    primary = windows.snapshot("a@2", 60)
    shadow = windows.snapshot("a@2", 60, shadow=True)
    assert (primary.num_requests, primary.num_errors, primary.shadow) == (3, 0, False)
    assert (shadow.num_requests, shadow.num_errors, shadow.shadow) == (2, 1, True)
    assert shadow.e2e is not None
    assert shadow.e2e.p50 == 9.0
    assert windows.versions() == ["a@2"]


def test_samples_are_the_window_s_successful_latencies() -> None:
    clock = FakeClock()
    windows = VersionWindows(horizon_s=600, bucket_s=10, clock=clock)
    for at, e2e in ((5.0, 1.0), (72.0, 2.0), (104.0, 3.0)):
        clock.now = at
        windows.observe("a@1", ok(e2e, ttft_s=e2e / 10))
    windows.observe("a@1", failed("engine_error"))  # no latency: not a sample
    windows.observe("a@1", ok(9.0, shadow=True))
    clock.now = 105.0
    assert windows.samples("a@1", 30, "e2e") == [2.0, 3.0]  # buckets [70, 80) onwards
    assert windows.samples("a@1", 105, "ttft") == pytest.approx([0.1, 0.2, 0.3])
    assert windows.samples("a@1", 105, "itl") == [0.02, 0.02, 0.02]
    assert windows.samples("a@1", 105, "e2e", shadow=True) == [9.0]
    assert windows.samples("a@9", 60, "e2e") == []
    with pytest.raises(ValueError, match="figure"):
        windows.samples("a@1", 60, "tpot")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window_s"):
        windows.samples("a@1", 601, "e2e")


def test_samples_are_bounded_by_the_reservoir() -> None:
    windows = VersionWindows(max_samples_per_bucket=64, clock=FakeClock())
    for i in range(1000):
        windows.observe("a@1", ok(float(i)))
    values = windows.samples("a@1", 60, "e2e")
    assert len(values) == 64
    assert set(values) <= {float(i) for i in range(1000)}


def test_the_reservoir_bounds_samples_and_stays_uniform() -> None:
    windows = VersionWindows(max_samples_per_bucket=512, clock=FakeClock())
    for i in range(20_000):
        windows.observe("a@1", ok(i / 20_000))
    e2e = windows.snapshot("a@1", 60).e2e
    assert e2e is not None
    assert (e2e.count, e2e.samples) == (20_000, 512)
    assert e2e.mean == pytest.approx(0.499975)  # exact, not sampled
    assert e2e.p50 == pytest.approx(0.5, abs=0.07)  # keeping the first 512 would give 0.013
    assert e2e.p99 == pytest.approx(0.99, abs=0.03)


def test_sampled_buckets_weigh_what_they_stand_for() -> None:
    clock = FakeClock()
    windows = VersionWindows(max_samples_per_bucket=16, clock=clock)
    for _ in range(10_000):  # a busy bucket: 16 samples for 10,000 requests
        windows.observe("a@1", ok(1.0))
    clock.now = 10.0
    for _ in range(10):  # a quiet one: 10 samples for 10 requests
        windows.observe("a@1", ok(100.0))
    e2e = windows.snapshot("a@1", 60).e2e
    assert e2e is not None
    assert (e2e.count, e2e.samples) == (10_010, 26)
    # 0.1 % of requests took 100 s: unweighted, 10 of 26 samples would put p90 at 100.
    assert (e2e.p50, e2e.p90, e2e.p99) == (1.0, 1.0, 1.0)
    assert e2e.mean == pytest.approx((10_000 + 1000) / 10_010)


def test_weighted_quantiles_match_the_definition() -> None:
    """Bisection over merged runs == the first sample (in value order) whose cumulative weight
    reaches p * count, computed the slow way over the very samples kept."""
    clock = FakeClock()
    windows = VersionWindows(max_samples_per_bucket=8, clock=clock, seed=3)
    rng = random.Random(11)
    for bucket, size in enumerate((3, 40, 8, 200, 1, 9)):
        clock.now = bucket * 10.0
        for _ in range(size):
            windows.observe("a@1", ok(round(rng.expovariate(1.0), 2)))
    e2e = windows.snapshot("a@1", 60).e2e
    assert e2e is not None
    kept = [
        (value, bucket.e2e.count / len(bucket.e2e.values))
        for bucket in windows._series[("a@1", False)]
        for value in bucket.e2e.values
    ]
    kept.sort()
    expected = []
    for percent in (50, 90, 95, 99):
        cumulative = 0.0
        for value, weight in kept:
            cumulative += weight
            if cumulative >= percent * 261 / 100 - 1e-6:
                expected.append(value)
                break
    assert (e2e.count, e2e.samples) == (261, 3 + 8 + 8 + 8 + 1 + 8)
    assert [e2e.p50, e2e.p90, e2e.p95, e2e.p99] == expected


def test_snapshot_to_dict_is_json() -> None:
    windows = VersionWindows(clock=FakeClock())
    windows.observe("a@1", ok(2.0))
    windows.observe("a@1", failed("engine_error"))
    data = json.loads(json.dumps(windows.snapshot("a@1", 60).to_dict()))
    assert data["version"] == "a@1"
    assert data["num_requests"] == 2
    assert data["errors"] == {"engine_error": 1}
    assert data["error_rate"] == 0.5
    assert data["e2e"]["p50"] == 2.0
    assert data["e2e"]["count"] == 1
    assert data["shadow"] is False


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="bucket_s"):
        VersionWindows(horizon_s=5, bucket_s=10)
    with pytest.raises(ValueError, match="max_samples_per_bucket"):
        VersionWindows(max_samples_per_bucket=0)

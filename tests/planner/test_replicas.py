"""How many workers each pool needs: the profile's model, the corrections, the predictors."""

from __future__ import annotations

import pytest

from planner.predict import ConstantPredictor, TrendPredictor
from planner.replicas import MAX_CORRECTION, Load, Observed, Targets, correction, needed
from tests.planner.test_profile import PROFILE

TARGETS = Targets(ttft_s=1.0, itl_s=0.04, headroom=1.0)


def test_each_pool_is_sized_from_its_own_side_of_the_load() -> None:
    # 10 req/s x 576 prompt tokens = 5,760 tokens/s at 3,000/s a worker: 2 prefill workers.
    # 10 req/s x 100 output tokens x 0.04 s = 40 streams at 8 a worker: 5 decode workers.
    got = needed(Load(10, 576, 100), PROFILE, TARGETS, Observed(), interval_s=30)
    assert (got.prefill, got.decode) == (2, 5)
    # The same requests with long answers and short prompts: the pools move apart.
    got = needed(Load(10, 128, 400), PROFILE, TARGETS, Observed(), interval_s=30)
    assert (got.prefill, got.decode) == (1, 20)


def test_no_traffic_needs_no_worker_and_a_backlog_needs_more() -> None:
    assert needed(Load(0, 0, 0), PROFILE, TARGETS, Observed(), 30).prefill == 0
    assert needed(Load(0, 0, 0), PROFILE, TARGETS, Observed(), 30).decode == 0
    # 240,000 queued prompt tokens to work off in a 30 s interval at 4,000/s a worker.
    backlog = Load(0, 128, 0, prefill_backlog_tokens=240_000)
    assert needed(backlog, PROFILE, TARGETS, Observed(), 30).prefill == 2


def test_latency_over_its_target_grows_only_its_own_pool() -> None:
    slow_ttft = needed(Load(10, 576, 100), PROFILE, TARGETS, Observed(ttft_s=2.0), 30)
    assert (slow_ttft.prefill, slow_ttft.decode) == (4, 5)
    fast = needed(Load(10, 576, 100), PROFILE, TARGETS, Observed(0.1, 0.01), 30)
    assert (fast.prefill, fast.decode) == (2, 5)  # beating the targets removes nothing


def test_a_correction_is_bounded() -> None:
    assert correction(None, 1.0) == 1.0
    assert correction(0.5, 1.0) == 1.0
    assert correction(100.0, 1.0) == MAX_CORRECTION


def test_headroom_keeps_capacity_in_reserve() -> None:
    reserved = Targets(ttft_s=1.0, itl_s=0.04, headroom=0.5)
    assert needed(Load(10, 576, 100), PROFILE, reserved, Observed(), 30).decode == 10


def test_the_trend_predictor_meets_a_ramp_and_starts_cold_without_a_trend() -> None:
    trend, constant = TrendPredictor(alpha=0.5, beta=0.5), ConstantPredictor()
    assert trend.predict() == constant.predict() == 0.0
    trend.observe(100.0)
    assert trend.predict() == 100.0  # one sample: no trend yet
    for value in (110.0, 120.0, 130.0, 140.0, 150.0):
        trend.observe(value)
        constant.observe(value)
    assert constant.predict() == 150.0
    assert trend.predict() > 150.0  # ahead of the ramp
    for _ in range(20):
        trend.observe(0.0)
    assert trend.predict() == 0.0  # never below zero


def test_predictor_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="alpha"):
        TrendPredictor(alpha=0)


def test_a_request_waiting_needs_one_decode_worker_whatever_the_rate() -> None:
    idle = needed(Load(0, 0, 0), PROFILE, TARGETS, Observed(), 30)
    waiting = needed(Load(0, 0, 0, waiting_requests=3), PROFILE, TARGETS, Observed(), 30)
    assert (idle.decode, waiting.decode) == (0, 1)
    assert waiting.prefill == 0  # no prompt tokens counted: no prefill worker for them
    # With prompt tokens queued too, prefill is sized from them as before.
    backlog = Load(0, 128, 0, prefill_backlog_tokens=240_000, waiting_requests=2)
    got = needed(backlog, PROFILE, TARGETS, Observed(), 30)
    assert (got.prefill, got.decode) == (2, 1)
    # A load that already needs decode workers gets no extra one for its waiting requests.
    busy = needed(Load(10, 576, 100, waiting_requests=50), PROFILE, TARGETS, Observed(), 30)
    assert busy.decode == 5

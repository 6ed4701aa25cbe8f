"""Scaling decisions: limits, up at once, down after a window and a cooldown, no flapping."""

from __future__ import annotations

import pytest

from planner.scaling import PoolScaler, ScalingPolicy

POLICY = ScalingPolicy(min_replicas=1, max_replicas=6, down_window_s=300, cooldown_s=60)


def test_up_at_once_down_only_after_the_whole_window() -> None:
    scaler, size = PoolScaler(POLICY), 1
    decision = scaler.decide(0, size, 4)
    assert (decision.desired, decision.reason) == (4, "load needs 4")
    size = decision.desired
    for now in range(30, 330, 30):  # the load drops at once; the pool waits
        assert scaler.decide(now, size, 1).desired == 4, now
    decision = scaler.decide(360, size, 1)  # 300 s after the last high recommendation
    assert decision.desired == 1
    assert "for 300 s" in decision.reason


def test_limits_bound_every_decision() -> None:
    scaler = PoolScaler(POLICY)
    assert scaler.decide(0, 1, 50).desired == 6
    assert scaler.decide(1, 0, 0).desired == 1  # below the floor: raised at once
    prefill = PoolScaler(ScalingPolicy(min_replicas=0, max_replicas=2, down_window_s=0,
                                       cooldown_s=0))  # fmt: skip
    assert prefill.decide(0, 1, 0).desired == 0  # a prefill pool may empty


def test_a_load_swinging_every_interval_does_not_flap() -> None:
    scaler, size, changes = PoolScaler(POLICY), 2, 0
    for step in range(120):  # an hour of 30 s intervals, alternating 2 and 4 workers' load
        decision = scaler.decide(step * 30.0, size, 4 if step % 2 else 2)
        changes += decision.changes
        size = decision.desired
    assert changes == 1 and size == 4  # up once, then held: the dips never last 300 s


def test_hysteresis_and_cooldown() -> None:
    wide = PoolScaler(ScalingPolicy(min_replicas=1, max_replicas=20, tolerance=0.2))
    assert wide.decide(0, 10, 11).desired == 10  # within 20 %
    assert wide.decide(1, 10, 13).desired == 13
    quick = PoolScaler(ScalingPolicy(max_replicas=8, down_window_s=0, cooldown_s=60))
    assert quick.decide(0, 1, 4).desired == 4
    assert quick.decide(30, 4, 1).desired == 4  # 30 s after a change: cooling down
    assert quick.decide(61, 4, 1).desired == 1


def test_a_planner_that_just_started_does_not_scale_down() -> None:
    scaler = PoolScaler(POLICY)
    assert scaler.decide(0, 4, 1).desired == 4
    assert scaler.decide(299, 4, 1).desired == 4
    assert scaler.decide(300, 4, 1).desired == 1


def test_a_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        ScalingPolicy(min_replicas=3, max_replicas=2)

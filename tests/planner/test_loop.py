"""One planning step: booting workers count as present and mute their pool's correction; a
trickle below one request an interval is no traffic."""

from __future__ import annotations

from planner.loop import Observation, Planner, PoolState
from planner.predict import ConstantPredictor
from planner.replicas import Load, Observed, Targets
from planner.scaling import ScalingPolicy
from tests.planner.test_profile import PROFILE

POLICY = ScalingPolicy(min_replicas=0, max_replicas=32, down_window_s=0, cooldown_s=0)


def _planner() -> Planner:
    return Planner(PROFILE, Targets(1.0, 0.04, 1.0), 30.0, POLICY, POLICY, ConstantPredictor)


def test_booting_workers_are_present_and_their_pools_latency_is_not_counted() -> None:
    load, slow = Load(10, 576, 100), Observed(ttft_s=3.0, itl_s=0.12)
    settled = _planner().step(0, Observation(load, slow, PoolState(2), PoolState(5)))
    assert (settled.prefill.desired, settled.decode.desired) == (6, 15)  # corrected x3
    booting = _planner().step(0, Observation(load, slow, PoolState(1, 1), PoolState(2, 3)))
    # The same load with the capacity on its way: the profile's answer, nothing added again.
    assert (booting.prefill.desired, booting.decode.desired) == (2, 5)
    assert not booting.prefill.changes and not booting.decode.changes


def test_a_trickle_below_one_request_an_interval_is_no_traffic() -> None:
    planner = _planner()
    trickle = Observation(Load(0.01, 576, 100), Observed(), PoolState(1), PoolState(1))
    step = planner.step(0, trickle)
    assert step.predicted.request_rate == 0
    assert (step.prefill.desired, step.decode.desired) == (0, 0)


def test_a_waiting_request_wakes_a_decode_pool_at_zero_at_once() -> None:
    # The gateway's own policy: down slowly, with a cooldown; up must still be immediate.
    slow_down = ScalingPolicy(min_replicas=0, max_replicas=4, down_window_s=300, cooldown_s=60)
    planner = Planner(PROFILE, Targets(1.0, 0.04, 1.0), 30.0, POLICY, slow_down, ConstantPredictor)
    idle = planner.step(0, Observation(Load(0, 0, 0), Observed(), PoolState(0), PoolState(0)))
    assert idle.decode.desired == 0  # without it, a pool at zero stays there
    waiting = Load(0, 0, 0, prefill_backlog_tokens=40, waiting_requests=1)
    step = planner.step(1, Observation(waiting, Observed(), PoolState(0), PoolState(0)))
    assert step.predicted.waiting_requests == 1
    assert (step.decode.current, step.decode.desired) == (0, 1)
    assert step.prefill.desired == 1  # its prompt tokens are a prefill backlog


def test_a_decode_pool_short_of_kv_memory_gets_one_more_worker() -> None:
    light = Load(1, 576, 100)  # one decode worker by the profile
    full = _planner().step(0, Observation(light, Observed(), PoolState(1), PoolState(2, 0, 0.93)))
    assert full.decode.desired == 3  # what runs, plus one
    roomy = _planner().step(0, Observation(light, Observed(), PoolState(1), PoolState(2, 0, 0.5)))
    assert roomy.decode.desired == roomy.needed.decode < 2
    # One already on its way: no second one for the same shortage.
    coming = _planner().step(0, Observation(light, Observed(), PoolState(1), PoolState(2, 1, 0.95)))
    assert coming.decode.desired == 3 and not coming.decode.changes

"""The real planner code driven through the shipped traces by the pool simulator
(bench/planner/sim.py): SLOs kept, replicas saved, pools moving apart, no flapping, and a
scale-down to zero prefill workers when traffic stops. (The figures are the simulation's, not
timings: ``python -m bench.planner.sim`` prints them.)"""

from __future__ import annotations

import pytest

from bench.planner.sim import TRACES, SimResult, config, simulate


@pytest.fixture(scope="module")
def day() -> SimResult:
    trace, duration_s = TRACES["day"]
    return simulate(trace, duration_s, config())


def _sizes_at(result: SimResult, hour: float) -> tuple[int, int]:
    interval = min(result.intervals, key=lambda i: abs(i.end_s - hour * 3600))
    return interval.prefill, interval.decode


def test_the_day_keeps_its_slos_on_far_fewer_replicas(day: SimResult) -> None:
    assert day.attainment >= 0.99
    assert day.savings >= 0.30
    assert day.events_per_hour <= 6


def test_prefill_and_decode_move_apart_when_the_mix_changes(day: SimResult) -> None:
    prompts_prefill, prompts_decode = _sizes_at(day, 11.5)  # long prompts, short answers
    answers_prefill, answers_decode = _sizes_at(day, 13.5)  # short prompts, long answers
    assert prompts_prefill > answers_prefill
    assert prompts_decode < answers_decode


def test_a_spike_is_met_and_then_given_back(day: SimResult) -> None:
    before, during, after = (_sizes_at(day, hour) for hour in (2.9, 3.2, 3.9))
    assert sum(during) > sum(before)
    assert sum(after) < sum(during)


def test_no_traffic_empties_the_prefill_pool_and_keeps_it_empty(day: SimResult) -> None:
    policy = config()
    quiet = [i for i in day.intervals if i.end_s >= 22.5 * 3600]
    assert {(i.prefill, i.decode) for i in quiet} == {
        (policy.prefill_policy.min_replicas, policy.decode_policy.min_replicas)
    }


@pytest.mark.parametrize("name", sorted(set(TRACES) - {"day"}))
def test_every_shipped_trace_runs_without_flapping(name: str) -> None:
    trace, duration_s = TRACES[name]
    result = simulate(trace, duration_s, config())
    assert result.events_per_hour <= 6
    assert result.attainment >= 0.95  # two-hour traces: a spike's boot time is a larger share

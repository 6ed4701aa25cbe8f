from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from bench.harness.arrivals import Arrival, LoadShape


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_closed_loop_has_no_schedule() -> None:
    shape = LoadShape(Arrival.CONCURRENCY, max_concurrency=4)
    assert shape.offsets(5, rng()) == [None] * 5
    assert math.isinf(shape.offered_rate)


def test_constant_rate_is_evenly_spaced() -> None:
    # vLLM's --burstiness inf: every gap 1/rate, the first too, the last at N / rate.
    assert LoadShape(Arrival.CONSTANT, rate=4).offsets(4, rng()) == [0.25, 0.5, 0.75, 1.0]


def test_infinite_rate_sends_everything_at_once() -> None:
    assert LoadShape(Arrival.POISSON).offsets(3, rng()) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("arrival", [Arrival.POISSON, Arrival.GAMMA])
def test_random_schedules_are_seeded_and_rescaled_to_n_over_rate(arrival: Arrival) -> None:
    shape = LoadShape(arrival, rate=5, burstiness=0.5)
    a, b = shape.offsets(200, rng(7)), shape.offsets(200, rng(7))
    assert a == b
    assert a != shape.offsets(200, rng(8))
    assert a[-1] == pytest.approx(200 / 5)  # vLLM rescales the same way
    assert all(later >= earlier for earlier, later in itertools.pairwise(a))


def test_lower_burstiness_gives_burstier_gaps() -> None:
    def gap_cv(burstiness: float) -> float:
        offsets = LoadShape(Arrival.GAMMA, rate=10, burstiness=burstiness).offsets(4000, rng(1))
        gaps = np.diff(np.array(offsets, dtype=float))
        return float(gaps.std() / gaps.mean())

    assert gap_cv(0.25) > 1.5 > gap_cv(1.0) > 0.8 > gap_cv(8.0)


def test_bursts_arrive_in_groups() -> None:
    shape = LoadShape(Arrival.BURST, burst_size=3, burst_interval_s=2.0)
    assert shape.offsets(7, rng()) == [0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 4.0]
    assert shape.offered_rate == 1.5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arrival": Arrival.CONCURRENCY}, "--concurrency"),
        ({"arrival": Arrival.POISSON, "rate": 0}, "--rate"),
        ({"arrival": Arrival.GAMMA, "rate": 1, "burstiness": 0}, "--burstiness"),
        ({"arrival": Arrival.BURST, "burst_size": 0}, "--burst-size"),
        ({"arrival": Arrival.CONSTANT, "rate": 1, "max_concurrency": 0}, "--max-concurrency"),
    ],
)
def test_bad_shapes_are_refused_naming_the_flag(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoadShape(**kwargs)  # type: ignore[arg-type]

"""rollouts.stats: Mann-Whitney U on hand-computed examples, its symmetry and rank invariance,
p-values under the null (seeded), a shift it must see; the two-proportion test; percentiles."""

from __future__ import annotations

import math
import random

import pytest

from rollouts.stats import MannWhitney, mann_whitney, percentile, two_proportion


def test_u_counts_the_pairs_where_the_candidate_is_larger() -> None:
    assert mann_whitney([1, 2, 3], [4, 5]).u == 0
    assert mann_whitney([4, 5], [1, 2, 3]).u == 6
    # Pairs (1,2) (1,3) (2,2) (2,3) (2,2) (2,3): two ties, each worth a half.
    assert mann_whitney([1, 2, 2], [2, 3]).u == 1.0
    assert mann_whitney([3, 1], [2]).u == 1


def test_z_and_p_by_hand() -> None:
    # n1=2, n2=3: mean 3, variance 2 * 3 / 12 * (5 + 1) = 3; z = (6 - 3 - 0.5) / sqrt(3).
    result = mann_whitney([4, 5], [1, 2, 3])
    assert result.z == pytest.approx(2.5 / math.sqrt(3))
    assert result.p_greater == pytest.approx(0.0745, abs=1e-4)
    # Ties: three 2s, so the variance is 6 / 12 * (6 - (27 - 3) / 20) = 2.4.
    tied = mann_whitney([1, 2, 2], [2, 3])
    assert tied.z == pytest.approx((1 - 3 - 0.5) / math.sqrt(2.4))
    assert tied.p_greater == pytest.approx(0.9467, abs=1e-4)


def test_swapping_the_sides_mirrors_u() -> None:
    rng = random.Random(7)
    a = [round(rng.gauss(0, 1), 1) for _ in range(40)]  # rounded: plenty of ties
    b = [round(rng.gauss(0.3, 1), 1) for _ in range(25)]
    ab, ba = mann_whitney(a, b), mann_whitney(b, a)
    assert ab.u + ba.u == pytest.approx(40 * 25)
    # The continuity correction leans towards the null both ways.
    assert ab.p_greater + ba.p_greater >= 1


def test_only_ranks_matter() -> None:
    rng = random.Random(3)
    a = [rng.gauss(0, 1) for _ in range(30)]
    b = [rng.gauss(0, 1) for _ in range(35)]
    assert mann_whitney([math.exp(x) for x in a], [math.exp(x) for x in b]) == mann_whitney(a, b)


def test_p_values_under_the_null_are_roughly_uniform() -> None:
    rng = random.Random(2024)
    p_values = [
        mann_whitney(
            [rng.lognormvariate(0, 0.5) for _ in range(30)],
            [rng.lognormvariate(0, 0.5) for _ in range(30)],
        ).p_greater
        for _ in range(200)
    ]
    assert 0.01 <= sum(p < 0.05 for p in p_values) / 200 <= 0.10
    assert 0.35 <= sum(p < 0.5 for p in p_values) / 200 <= 0.65


def test_a_shift_gives_a_tiny_p_and_the_other_way_a_large_one() -> None:
    rng = random.Random(11)
    baseline = [rng.gauss(0, 1) for _ in range(100)]
    slower = [rng.gauss(1, 1) for _ in range(100)]
    assert mann_whitney(slower, baseline).p_greater < 1e-6
    assert mann_whitney(baseline, slower).p_greater > 1 - 1e-6


def test_all_tied_is_no_evidence() -> None:
    assert mann_whitney([1.0] * 5, [1.0] * 7) == MannWhitney(u=17.5, z=0.0, p_greater=1.0)
    assert mann_whitney([2.0], [1.0]).p_greater < 1  # one value each: defined, if meaningless


def test_empty_sides_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one value"):
        mann_whitney([], [1.0])
    with pytest.raises(ValueError, match="at least one value"):
        mann_whitney([1.0], [])


def test_two_proportion() -> None:
    assert two_proportion(50, 1000, 5, 1000) < 1e-8
    assert two_proportion(5, 1000, 50, 1000) > 1 - 1e-8
    assert two_proportion(10, 1000, 10, 1000) == pytest.approx(0.5)
    assert two_proportion(0, 100, 0, 300) == 1.0
    assert two_proportion(100, 100, 300, 300) == 1.0
    # 12 % against 10 % of 100: z = 0.02 / sqrt(0.11 * 0.89 * 0.02).
    assert two_proportion(12, 100, 10, 100) == pytest.approx(
        0.5 * math.erfc(0.02 / math.sqrt(0.11 * 0.89 * 0.02) / math.sqrt(2))
    )
    with pytest.raises(ValueError, match="one trial"):
        two_proportion(0, 0, 1, 10)
    with pytest.raises(ValueError, match="between 0"):
        two_proportion(11, 10, 1, 10)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]
    assert [percentile(values, q) for q in (50, 90, 95, 99, 100)] == [50, 90, 95, 99, 100]
    small = [float(v) for v in range(1, 11)]
    assert [percentile(small, q) for q in (50, 90, 95, 99)] == [5, 9, 10, 10]
    assert percentile(small, 0.001) == 1
    assert percentile([float(v) for v in range(1, 101)], 57) == 57  # 57 * 100 / 100 in floats
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must be"):
        percentile(small, 0)

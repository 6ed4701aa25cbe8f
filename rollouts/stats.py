"""The statistics rollout gates lean on: pure Python, no numpy or scipy, no state.

- ``mann_whitney``: the Mann-Whitney U test (Wilcoxon rank-sum), one-sided, of "the candidate's
  values tend to be larger than the baseline's". Kayenta's judge compares canary and baseline
  with it. Rank-based, so it makes no assumption about the shape of a latency distribution and a
  few huge outliers move it no more than any other large value would.
- ``two_proportion``: the pooled two-proportion z-test, one-sided, of "the candidate's rate of
  some event (errors, moderation blocks) is higher than the baseline's".
- ``percentile``: nearest-rank, as ``traffic.windows`` reads its quantiles.

When the normal approximations hold: the U statistic's distribution is close to normal once both
samples have about 20 values or more (with the tie and continuity corrections used here, p-values
are then within a few thousandths of the exact ones). Below that the p-values are only indicative,
which is one reason every gate has a ``min_samples``. The two-proportion test wants the expected
counts of events and non-events on each side to be about 5 or more; with rarer events it is
conservative near zero events, and gates pair it with an additive floor anyway.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MannWhitney:
    """The outcome of ``mann_whitney(candidate, baseline)``."""

    u: float
    """The candidate's U: how many (candidate, baseline) pairs have the candidate larger, ties
    counting one half. Between 0 and ``len(candidate) * len(baseline)``."""
    z: float
    """The standardised U (tie- and continuity-corrected); positive: the candidate is larger."""
    p_greater: float
    """One-sided p-value of "candidate values tend to be larger than baseline values": small
    means strong evidence that they are."""


def mann_whitney(candidate: Sequence[float], baseline: Sequence[float]) -> MannWhitney:
    """The one-sided Mann-Whitney U test of candidate > baseline, by the normal approximation
    with tie correction and continuity correction. O(n log n) for n values in all.

    Valid when both samples have about 20 values or more (see the module docstring). When every
    value is tied, U cannot vary at all: there is no evidence, and ``p_greater`` is 1.
    """
    n1, n2 = len(candidate), len(baseline)
    if n1 == 0 or n2 == 0:
        raise ValueError("mann_whitney needs at least one value on each side")
    # True sorts after False: the candidate's copy of a tied value comes second, which only
    # matters for stability; ties get their mean rank below.
    pooled = sorted([(value, True) for value in candidate] + [(value, False) for value in baseline])
    n = n1 + n2
    rank_sum = 0.0  # of the candidate's values
    tie_term = 0  # sum over groups of tied values of t^3 - t
    start = 0
    while start < n:
        end = start
        while end + 1 < n and pooled[end + 1][0] == pooled[start][0]:
            end += 1
        # Ranks start + 1 .. end + 1 (1-based): their mean goes to every value of the group.
        mean_rank = (start + end + 2) / 2
        size = end - start + 1
        rank_sum += mean_rank * sum(
            1 for _, is_candidate in pooled[start : end + 1] if is_candidate
        )
        tie_term += size**3 - size
        start = end + 1
    u = rank_sum - n1 * (n1 + 1) / 2
    mean = n1 * n2 / 2
    variance = n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1))) if n > 1 else 0.0
    if variance <= 0:
        return MannWhitney(u=u, z=0.0, p_greater=1.0)
    # Continuity correction towards the null: U takes steps of 1/2, the normal is continuous.
    z = (u - mean - 0.5) / math.sqrt(variance)
    return MannWhitney(u=u, z=z, p_greater=_upper_tail(z))


def two_proportion(
    candidate_events: int, candidate_total: int, baseline_events: int, baseline_total: int
) -> float:
    """One-sided p-value of "the candidate's event rate is higher than the baseline's", by the
    pooled two-proportion z-test. 1.0 when neither side had an event (or both had only events):
    identical all-or-nothing rates carry no evidence."""
    if candidate_total <= 0 or baseline_total <= 0:
        raise ValueError("two_proportion needs at least one trial on each side")
    if not (0 <= candidate_events <= candidate_total and 0 <= baseline_events <= baseline_total):
        raise ValueError("events must be between 0 and the number of trials")
    pooled = (candidate_events + baseline_events) / (candidate_total + baseline_total)
    variance = pooled * (1 - pooled) * (1 / candidate_total + 1 / baseline_total)
    if variance <= 0:
        return 1.0
    difference = candidate_events / candidate_total - baseline_events / baseline_total
    return _upper_tail(difference / math.sqrt(variance))


def percentile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100): the smallest value with at least
    q % of the samples at or below it, as ``traffic.windows`` computes its quantiles."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 < q <= 100:
        raise ValueError(f"q must be more than 0 and at most 100, not {q}")
    ordered = sorted(samples)
    rank = math.ceil(q * len(ordered) / 100 - 1e-9)  # the slack absorbs float rounding of q * n
    return ordered[max(rank, 1) - 1]


def _upper_tail(z: float) -> float:
    """P(Z >= z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2))

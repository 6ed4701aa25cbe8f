"""Sliding windows of per-version figures: what rollout gates judge a version by.

Each version has two series of time buckets (``bucket_s`` wide), one for the traffic it serves
and one for shadow copies, kept apart so a shadow's figures never mix with the primary's. A
bucket counts requests, errors by kind, output tokens, finish reasons and moderation actions,
and keeps latency samples (TTFT, mean ITL, E2E) of its successful requests: all of them up to
``max_samples_per_bucket``, then a uniform reservoir sample (Algorithm R, seeded), so memory is
bounded by ``horizon_s / bucket_s * max_samples_per_bucket`` per figure and series.

A window of ``window_s`` covers every bucket that overlaps the last ``window_s`` seconds (so at
least ``window_s`` of history, at most one bucket more); buckets older than ``horizon_s`` by the
same rule are dropped as the series is touched. Latency figures cover successful requests only:
a version that fails fast must not look faster; its failures are in ``error_rate``.

Quantiles are nearest-rank. Past the reservoir cap, a bucket's samples stand for more requests
than they are (count / samples each), and are weighted so: a busy minute is not outvoted by a
quiet one. Means and counts are exact, over every request.
"""

from __future__ import annotations

import math
import random
import time
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal

_PERCENTS = (50, 90, 95, 99)


@dataclass(frozen=True, slots=True)
class RequestFigures:
    """What one ended request says about the version that served it."""

    ttft_s: float | None
    """Time to first token; None when none came."""
    itl_s: float | None
    """Mean inter-token latency of the request; None with fewer than two tokens."""
    e2e_s: float
    error: str | None
    """The error kind's code; None: the request succeeded."""
    output_tokens: int
    finish_reason: str | None
    moderation: str | None
    """The strictest moderation action taken on it, None when none."""
    shadow: bool = False
    """A shadow copy: its answer went nowhere."""
    input_tokens: int = 0
    """Its prompt's tokens (the engine's count, else the gateway's estimate)."""


@dataclass(frozen=True, slots=True)
class Quantiles:
    """Nearest-rank quantiles of one latency figure over a window, in seconds."""

    p50: float
    p90: float
    p95: float
    p99: float
    mean: float
    count: int
    """Requests the figure was measured on (the mean is over all of them)."""
    samples: int
    """Samples the quantiles were read from (fewer than ``count`` past the reservoir cap)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return {
            "p50": self.p50,
            "p90": self.p90,
            "p95": self.p95,
            "p99": self.p99,
            "mean": self.mean,
            "count": self.count,
            "samples": self.samples,
        }


@dataclass(frozen=True, slots=True)
class WindowSnapshot:
    """A version's figures over the last ``window_s`` seconds (primary or shadow traffic)."""

    version: str
    window_s: float
    """The window asked for; its figures cover ``covered_s``."""
    num_requests: int
    num_errors: int
    errors: dict[str, int]
    """Errors by kind."""
    error_rate: float
    """``num_errors / num_requests``; 0.0 without requests."""
    ttft: Quantiles | None
    itl: Quantiles | None
    e2e: Quantiles | None
    output_tokens: int
    finish_reasons: dict[str, int]
    moderation: dict[str, int]
    """Requests by the strictest moderation action taken on them."""
    shadow: bool = False
    input_tokens: int = 0
    """Prompt tokens of the requests in the window."""
    covered_s: float | None = None
    """The seconds its whole buckets span (``window_s`` rounded out to bucket edges, up to
    now): a rate is a count over this, not over ``window_s``. None: not known."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return {
            "version": self.version,
            "window_s": self.window_s,
            "shadow": self.shadow,
            "num_requests": self.num_requests,
            "num_errors": self.num_errors,
            "errors": dict(self.errors),
            "error_rate": self.error_rate,
            "ttft": None if self.ttft is None else self.ttft.to_dict(),
            "itl": None if self.itl is None else self.itl.to_dict(),
            "e2e": None if self.e2e is None else self.e2e.to_dict(),
            "output_tokens": self.output_tokens,
            "input_tokens": self.input_tokens,
            "finish_reasons": dict(self.finish_reasons),
            "moderation": dict(self.moderation),
        }


class _Samples:
    """One latency figure of one bucket: exact count and sum, bounded reservoir of values."""

    __slots__ = ("count", "is_sorted", "total", "values")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.values = array("d")  # 8 bytes a sample, not a boxed float's 32
        self.is_sorted = True

    def add(self, value: float, cap: int, rng: random.Random) -> None:
        self.count += 1
        self.total += value
        if len(self.values) < cap:
            self.values.append(value)
            self.is_sorted = False
        else:
            # Algorithm R: every value seen so far stays with probability cap / count. The
            # slot's position carries no meaning, so sorting the reservoir in place is harmless.
            slot = rng.randrange(self.count)
            if slot < cap:
                self.values[slot] = value
                self.is_sorted = False

    def sorted_values(self) -> array[float]:
        """The samples, sorted in place once: a closed bucket is sorted by one snapshot for all
        the later ones."""
        if not self.is_sorted:
            self.values = array("d", sorted(self.values))
            self.is_sorted = True
        return self.values


class _Bucket:
    __slots__ = (
        "e2e",
        "errors",
        "finish_reasons",
        "index",
        "input_tokens",
        "itl",
        "moderation",
        "num_errors",
        "num_requests",
        "output_tokens",
        "ttft",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.num_requests = 0
        self.num_errors = 0
        self.errors: dict[str, int] = {}
        self.output_tokens = 0
        self.input_tokens = 0
        self.finish_reasons: dict[str, int] = {}
        self.moderation: dict[str, int] = {}
        self.ttft = _Samples()
        self.itl = _Samples()
        self.e2e = _Samples()


class VersionWindows:
    """Time-bucketed figures per version, primary and shadow apart."""

    def __init__(
        self,
        horizon_s: float = 3600,
        bucket_s: float = 10,
        max_samples_per_bucket: int = 512,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
    ) -> None:
        if bucket_s <= 0 or horizon_s < bucket_s:
            raise ValueError("bucket_s must be more than 0 and horizon_s at least bucket_s")
        if max_samples_per_bucket < 1:
            raise ValueError("max_samples_per_bucket must be at least 1")
        self.horizon_s = horizon_s
        self.bucket_s = bucket_s
        self.max_samples_per_bucket = max_samples_per_bucket
        self._clock = clock
        self._rng = random.Random(seed)
        self._series: dict[tuple[str, bool], deque[_Bucket]] = {}

    def observe(self, version: str, figures: RequestFigures) -> None:
        """Count one ended request of ``version`` in the current bucket. O(1) amortised."""
        now = self._clock()
        series = self._series.setdefault((version, figures.shadow), deque())
        index = math.floor(now / self.bucket_s)
        # A clock that stepped back (it should not) lands in the newest bucket, keeping order.
        if not series or series[-1].index < index:
            series.append(_Bucket(index))
            self._expire(series, now)
        bucket = series[-1]
        bucket.num_requests += 1
        bucket.output_tokens += figures.output_tokens
        bucket.input_tokens += figures.input_tokens
        if figures.finish_reason is not None:
            _count(bucket.finish_reasons, figures.finish_reason)
        if figures.moderation is not None:
            _count(bucket.moderation, figures.moderation)
        if figures.error is not None:
            bucket.num_errors += 1
            _count(bucket.errors, figures.error)
            return
        cap, rng = self.max_samples_per_bucket, self._rng
        if figures.ttft_s is not None:
            bucket.ttft.add(figures.ttft_s, cap, rng)
        if figures.itl_s is not None:
            bucket.itl.add(figures.itl_s, cap, rng)
        bucket.e2e.add(figures.e2e_s, cap, rng)

    def snapshot(self, version: str, window_s: float, *, shadow: bool = False) -> WindowSnapshot:
        """``version``'s figures over the last ``window_s`` seconds, of its primary traffic or
        (``shadow=True``) of the shadow copies it received."""
        if not 0 < window_s <= self.horizon_s:
            raise ValueError(
                f"window_s must be more than 0 and at most {self.horizon_s} (horizon_s)"
            )
        now = self._clock()
        series = self._series.get((version, shadow))
        buckets: list[_Bucket] = []
        if series is not None:
            self._expire(series, now)
            first = self._first_index(now, window_s)
            buckets = [bucket for bucket in series if bucket.index >= first]
        num_requests = sum(bucket.num_requests for bucket in buckets)
        num_errors = sum(bucket.num_errors for bucket in buckets)
        return WindowSnapshot(
            version=version,
            window_s=window_s,
            num_requests=num_requests,
            num_errors=num_errors,
            errors=_merge(bucket.errors for bucket in buckets),
            error_rate=num_errors / num_requests if num_requests else 0.0,
            ttft=_quantiles([bucket.ttft for bucket in buckets]),
            itl=_quantiles([bucket.itl for bucket in buckets]),
            e2e=_quantiles([bucket.e2e for bucket in buckets]),
            output_tokens=sum(bucket.output_tokens for bucket in buckets),
            input_tokens=sum(bucket.input_tokens for bucket in buckets),
            finish_reasons=_merge(bucket.finish_reasons for bucket in buckets),
            moderation=_merge(bucket.moderation for bucket in buckets),
            shadow=shadow,
            covered_s=now - self._first_index(now, window_s) * self.bucket_s,
        )

    def samples(
        self,
        version: str,
        window_s: float,
        figure: Literal["ttft", "itl", "e2e"],
        *,
        shadow: bool = False,
    ) -> list[float]:
        """The latency samples of ``figure`` (seconds, successful requests only) kept in the
        buckets of the last ``window_s`` seconds, oldest bucket first, for a statistical test
        that needs the values themselves (a rank test of candidate against baseline).

        Past the reservoir cap a bucket keeps fewer samples than it saw requests, so a busy
        bucket is under-represented next to a quiet one; the quantiles of ``snapshot`` weigh
        them, these raw values do not."""
        if figure not in ("ttft", "itl", "e2e"):
            raise ValueError(f"figure must be 'ttft', 'itl' or 'e2e', not {figure!r}")
        if not 0 < window_s <= self.horizon_s:
            raise ValueError(
                f"window_s must be more than 0 and at most {self.horizon_s} (horizon_s)"
            )
        now = self._clock()
        series = self._series.get((version, shadow))
        if series is None:
            return []
        self._expire(series, now)
        first = self._first_index(now, window_s)
        values: list[float] = []
        for bucket in series:
            if bucket.index >= first:
                parts = {"ttft": bucket.ttft, "itl": bucket.itl, "e2e": bucket.e2e}
                values.extend(parts[figure].values)
        return values

    def versions(self) -> list[str]:
        """Versions with figures within the horizon, sorted; forgets the others."""
        now = self._clock()
        for key, series in list(self._series.items()):
            self._expire(series, now)
            if not series:
                del self._series[key]
        return sorted({version for version, _ in self._series})

    def _first_index(self, now: float, span_s: float) -> int:
        """The oldest bucket that overlaps the last ``span_s`` seconds: (index + 1) * bucket_s
        > now - span_s."""
        return math.floor((now - span_s) / self.bucket_s)

    def _expire(self, series: deque[_Bucket], now: float) -> None:
        first = self._first_index(now, self.horizon_s)
        while series and series[0].index < first:
            series.popleft()


def _count(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def _merge(parts: Iterable[dict[str, int]]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for part in parts:
        for key, value in part.items():
            merged[key] = merged.get(key, 0) + value
    return dict(sorted(merged.items()))


def _quantiles(parts: list[_Samples]) -> Quantiles | None:
    """Nearest-rank quantiles over the buckets' samples, each weighing count / samples."""
    count = sum(part.count for part in parts)
    if count == 0:
        return None
    runs = [(part.sorted_values(), part.count / len(part.values)) for part in parts if part.values]
    # Sorted runs: the sort merges them instead of sorting from scratch.
    merged = sorted(chain.from_iterable(run for run, _ in runs))
    results = []
    if len(merged) == count:  # nothing sampled away: the textbook rank ceil(p * count)
        results = [merged[-(-percent * count // 100) - 1] for percent in _PERCENTS]
    else:
        # The first sample whose cumulative weight reaches p * count, found by bisecting the
        # merged samples (weight up to x: each run's rank of x times its weight). The slack
        # absorbs float rounding in the weights.
        slack = count * 1e-9
        low = 0
        for percent in _PERCENTS:
            target = percent * count / 100 - slack
            high = len(merged) - 1
            while low < high:
                middle = (low + high) // 2
                if _weight_upto(runs, merged[middle]) >= target:
                    high = middle
                else:
                    low = middle + 1
            results.append(merged[low])
    return Quantiles(
        p50=results[0],
        p90=results[1],
        p95=results[2],
        p99=results[3],
        mean=sum(part.total for part in parts) / count,
        count=count,
        samples=len(merged),
    )


def _weight_upto(runs: list[tuple[array[float], float]], value: float) -> float:
    return sum(weight * bisect_right(run, value) for run, weight in runs)

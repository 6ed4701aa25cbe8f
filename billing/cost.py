"""Measured cost: what serving a deployment's tokens cost, per 1k tokens, over sliding windows.

Every worker has a configured price (``WorkerCost.micros_per_hour``: its GPUs or CPUs as the
cloud bills them). The telemetry loop reports, per worker and tick, how many of the tick's wall
seconds the worker was busy; billing reports every request's tokens and what it was charged.
The meter turns both into figures per (deployment, model_version, window), on two bases:

- **busy**: price x busy seconds. The cost of the work the engine actually did: it measures the
  engine's efficiency (tokens per busy GPU-second), independent of how loaded the pool was.
- **provisioned**: price x wall seconds. What the operator pays whether the workers are busy or
  idle: the cloud bill. The margin is charged minus this.

Both exist because they answer different questions: a new model version can be cheaper per
busy second yet cost more per token provisioned if it takes less traffic, and a rollout gate
must see both (busy: did the engine get worse? provisioned and margin: are we losing money?).

Windows slide: observations go into one-second buckets in a deque; buckets older than the
largest window are dropped, so memory is bounded by that window. A window longer than the
meter has been observing covers the observed span, and its ``wall_s`` says so.

Money is exact: prices and charges are integer micro-dollars (1 USD = 1_000_000), time is
accumulated as integer microseconds, and figures are ``Decimal`` computed with one division.
One lock guards the buckets, so a scrape rendered in another thread cannot see them mid-update.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Context, Decimal

MICROS_PER_USD = 1_000_000
_US_PER_S = 1_000_000
_US_PER_HOUR = 3600 * _US_PER_S
# Its own context: the figures must not depend on whatever a thread set as the default one.
_DECIMAL = Context(prec=28, rounding=ROUND_HALF_EVEN)


@dataclass(frozen=True, slots=True)
class WorkerCost:
    """One worker's configured price."""

    worker: str
    """The worker's name, as the telemetry loop reports it."""
    deployment: str
    """The model name clients ask for."""
    model_version: str
    """Which version of the deployment the worker serves (a rollout runs two side by side)."""
    micros_per_hour: int
    """What the worker's hardware costs per hour, in micro-dollars."""


@dataclass(frozen=True, slots=True)
class CostFigure:
    """One deployment version's cost over one window. Per-1k figures are in USD and ``None``
    when no tokens were served in the window."""

    deployment: str
    model_version: str
    window_s: float
    """The window asked for."""
    wall_s: float
    """The span the figures cover: ``window_s``, or less while the meter is younger."""
    num_tokens: int
    """Prompt + completion tokens of the requests billed in the window."""
    busy_s: float
    """Worker-seconds busy, summed over the deployment's workers."""
    worker_s: float
    """Worker-seconds observed (provisioned), summed over the deployment's workers."""
    busy_cost_micros: Decimal
    """Sum over workers of ``micros_per_hour x busy_s / 3600``; exact, not rounded."""
    provisioned_cost_micros: Decimal
    """Sum over workers of ``micros_per_hour x wall_s / 3600``: what the cloud bill says."""
    charged_micros: int
    """What the window's requests were charged."""
    busy_usd_per_1k_tokens: Decimal | None
    provisioned_usd_per_1k_tokens: Decimal | None
    charged_usd_per_1k_tokens: Decimal | None
    margin_micros: Decimal
    """Charged minus provisioned cost."""
    margin_ratio: Decimal | None
    """``margin_micros / charged_micros`` (gross margin); ``None`` when nothing was charged."""


@dataclass(slots=True)
class _Totals:
    busy_us: int = 0
    worker_us: int = 0
    # Micro-dollars per hour x microseconds: integers, divided once by _US_PER_HOUR at the end.
    busy_cost: int = 0
    provisioned_cost: int = 0
    num_tokens: int = 0
    charged_micros: int = 0

    def add(self, other: _Totals) -> None:
        self.busy_us += other.busy_us
        self.worker_us += other.worker_us
        self.busy_cost += other.busy_cost
        self.provisioned_cost += other.provisioned_cost
        self.num_tokens += other.num_tokens
        self.charged_micros += other.charged_micros


@dataclass(slots=True)
class _Bucket:
    second: int
    """``floor`` of the observations' time: an observation at ``at`` covers up to ``at``."""
    totals: dict[tuple[str, str], _Totals] = field(default_factory=dict)

    def totals_for(self, key: tuple[str, str]) -> _Totals:
        totals = self.totals.get(key)
        if totals is None:
            totals = self.totals[key] = _Totals()
        return totals


def _checked(worker: WorkerCost) -> WorkerCost:
    if worker.micros_per_hour < 0:
        raise ValueError(
            f"worker {worker.worker!r}: micros_per_hour must be >= 0, got {worker.micros_per_hour}"
        )
    return worker


class CostMeter:
    """Busy and provisioned cost against tokens served, per deployment version and window."""

    def __init__(
        self,
        workers: Sequence[WorkerCost],
        windows_s: Sequence[float] = (60.0, 300.0, 3600.0),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``workers``: every priced worker (names unique); ``windows_s``: the sliding windows
        reported; ``clock``: seconds, the same clock as the ``at`` arguments."""
        self._workers: dict[str, WorkerCost] = {}
        for worker in workers:
            if worker.worker in self._workers:
                raise ValueError(f"worker {worker.worker!r} is priced twice: keep one entry")
            self._workers[worker.worker] = _checked(worker)
        if not windows_s or any(not w > 0 for w in windows_s):
            raise ValueError(f"windows_s must be positive seconds, got {list(windows_s)}")
        self._windows_s = tuple(sorted(set(windows_s)))
        self._clock = clock
        self._buckets: deque[_Bucket] = deque()
        self._first_at: float | None = None
        self._lock = threading.Lock()

    @property
    def windows_s(self) -> tuple[float, ...]:
        """The windows reported, shortest first."""
        return self._windows_s

    def add_worker(self, worker: WorkerCost) -> None:
        """Price a worker deployed after the meter was built (a new version's)."""
        with self._lock:
            self._workers[worker.worker] = _checked(worker)

    def price_of(self, worker: str) -> WorkerCost | None:
        """The price ``worker`` is measured at; None when it has none."""
        with self._lock:
            return self._workers.get(worker)

    def has_worker(self, worker: str) -> bool:
        """Whether ``worker`` has a price (``observe_busy`` refuses the others)."""
        return worker in self._workers

    def observe_busy(
        self, worker: str, busy_s: float, wall_s: float, at: float | None = None
    ) -> None:
        """``worker`` was busy ``busy_s`` of the ``wall_s`` seconds ending at ``at`` (default:
        now). Raises ``KeyError`` for a worker without a price."""
        price = self._workers[worker]
        if not 0 <= busy_s <= wall_s:
            raise ValueError(f"need 0 <= busy_s <= wall_s, got busy_s={busy_s} wall_s={wall_s}")
        at = self._clock() if at is None else at
        wall_us = round(wall_s * _US_PER_S)
        busy_us = min(round(busy_s * _US_PER_S), wall_us)
        with self._lock:
            bucket = self._bucket(at)
            if bucket is None:
                return
            self._started(at - wall_s)
            acc = bucket.totals_for((price.deployment, price.model_version))
            acc.busy_us += busy_us
            acc.worker_us += wall_us
            acc.busy_cost += price.micros_per_hour * busy_us
            acc.provisioned_cost += price.micros_per_hour * wall_us

    def observe_tokens(
        self,
        deployment: str,
        model_version: str,
        num_tokens: int,
        charged_micros: int,
        at: float | None = None,
    ) -> None:
        """A billed request: its prompt + completion tokens and what it was charged."""
        if num_tokens < 0 or charged_micros < 0:
            raise ValueError(
                f"need num_tokens >= 0 and charged_micros >= 0, "
                f"got {num_tokens} and {charged_micros}"
            )
        at = self._clock() if at is None else at
        with self._lock:
            bucket = self._bucket(at)
            if bucket is None:
                return
            self._started(at)
            acc = bucket.totals_for((deployment, model_version))
            acc.num_tokens += num_tokens
            acc.charged_micros += charged_micros

    def snapshot(
        self, now: float | None = None, windows_s: Sequence[float] | None = None
    ) -> list[CostFigure]:
        """One figure per (deployment, model_version, window), sorted; every priced deployment
        appears, with zeros when idle. ``windows_s``: other windows than the meter's (a
        rollout step's age), each at most the longest of the meter's, which bounds what it
        keeps."""
        now = self._clock() if now is None else now
        if windows_s is None:
            spans = self._windows_s
        else:
            spans = tuple(sorted(set(windows_s)))
            if not spans or not all(0 < w <= self._windows_s[-1] for w in spans):
                raise ValueError(
                    f"windows_s must be positive seconds up to {self._windows_s[-1]:g}"
                )
        keys = {(w.deployment, w.model_version) for w in self._workers.values()}
        sums = {(key, window): _Totals() for key in keys for window in spans}
        with self._lock:
            self._expire(now)
            for bucket in reversed(self._buckets):  # newest first, so each window stops early
                if bucket.second > now:
                    continue
                windows = [w for w in spans if bucket.second > now - w]
                if not windows:
                    break
                for key, totals in bucket.totals.items():
                    if (key, windows[0]) not in sums:  # tokens of a deployment without a price
                        sums.update({(key, w): _Totals() for w in spans})
                    for window in windows:
                        sums[(key, window)].add(totals)
            first_at = self._first_at
        observed_s = 0.0 if first_at is None else max(0.0, now - first_at)
        return [
            _figure(key, window, min(window, observed_s), totals)
            for (key, window), totals in sorted(sums.items())
        ]

    def _started(self, at: float) -> None:
        if self._first_at is None or at < self._first_at:
            self._first_at = at

    def _bucket(self, at: float) -> _Bucket | None:
        """The bucket of time ``at`` (created in order), or None when it is already expired."""
        second = math.floor(at)
        buckets = self._buckets
        if not buckets or buckets[-1].second < second:
            buckets.append(_Bucket(second))
            self._expire(at)
            return buckets[-1]
        # Late observations (another clock reading raced ahead): walk back from the newest.
        for i in range(len(buckets) - 1, -1, -1):
            if buckets[i].second == second:
                return buckets[i]
            if buckets[i].second < second:
                buckets.insert(i + 1, _Bucket(second))
                return buckets[i + 1]
        if second <= buckets[-1].second - self._windows_s[-1]:
            return None
        buckets.appendleft(_Bucket(second))
        return buckets[0]

    def _expire(self, now: float) -> None:
        horizon = now - self._windows_s[-1]
        while self._buckets and self._buckets[0].second <= horizon:
            self._buckets.popleft()


def _figure(key: tuple[str, str], window_s: float, wall_s: float, t: _Totals) -> CostFigure:
    busy_micros = _div(t.busy_cost, _US_PER_HOUR)
    provisioned_micros = _div(t.provisioned_cost, _US_PER_HOUR)
    margin = Decimal(t.charged_micros) - provisioned_micros
    # USD per 1k tokens = micros / MICROS_PER_USD x 1000 / tokens: one division, from integers.
    per_1k = t.num_tokens * MICROS_PER_USD // 1000
    return CostFigure(
        deployment=key[0],
        model_version=key[1],
        window_s=window_s,
        wall_s=wall_s,
        num_tokens=t.num_tokens,
        busy_s=t.busy_us / _US_PER_S,
        worker_s=t.worker_us / _US_PER_S,
        busy_cost_micros=busy_micros,
        provisioned_cost_micros=provisioned_micros,
        charged_micros=t.charged_micros,
        busy_usd_per_1k_tokens=_div(t.busy_cost, _US_PER_HOUR * per_1k) if per_1k else None,
        provisioned_usd_per_1k_tokens=(
            _div(t.provisioned_cost, _US_PER_HOUR * per_1k) if per_1k else None
        ),
        charged_usd_per_1k_tokens=_div(t.charged_micros, per_1k) if per_1k else None,
        margin_micros=margin,
        margin_ratio=(
            _DECIMAL.divide(margin, Decimal(t.charged_micros)) if t.charged_micros else None
        ),
    )


def _div(numerator: int, denominator: int) -> Decimal:
    return _DECIMAL.divide(Decimal(numerator), Decimal(denominator))


def figures_to_json(figures: Iterable[CostFigure]) -> dict[str, object]:
    """The figures as a JSON-serialisable dict for the admin API: Decimals as strings (exact),
    ``None`` as null."""

    def text(value: Decimal | None) -> str | None:
        return None if value is None else str(value)

    return {
        "figures": [
            {
                "deployment": f.deployment,
                "model_version": f.model_version,
                "window_s": f.window_s,
                "wall_s": f.wall_s,
                "num_tokens": f.num_tokens,
                "busy_s": f.busy_s,
                "worker_s": f.worker_s,
                "busy_cost_micros": str(f.busy_cost_micros),
                "provisioned_cost_micros": str(f.provisioned_cost_micros),
                "charged_micros": f.charged_micros,
                "usd_per_1k_tokens": {
                    "busy": text(f.busy_usd_per_1k_tokens),
                    "provisioned": text(f.provisioned_usd_per_1k_tokens),
                    "charged": text(f.charged_usd_per_1k_tokens),
                },
                "margin_micros": str(f.margin_micros),
                "margin_ratio": text(f.margin_ratio),
            }
            for f in figures
        ]
    }

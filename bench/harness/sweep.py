"""Find the highest request rate that still meets the SLOs.

Each point is a full run at one Poisson rate (same seed, so the same prompts). Rates are tried in
ascending order until one fails (past it the server is overloaded and further points only take
time), then the interval between the last passing and the first failing rate is bisected
``refine`` times. A point passes when at least ``slo_attainment`` of its requests met every SLO.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from bench.harness.arrivals import Arrival, LoadShape
from bench.harness.result import RunResult
from bench.harness.run import RunConfig

RunAt = Callable[[RunConfig], Awaitable[RunResult]]


@dataclasses.dataclass(frozen=True, slots=True)
class SweepPoint:
    rate: float
    result: RunResult
    meets_slos: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "summary": self.result.summary.to_dict(),
            "meets_slos": self.meets_slos,
        }


async def sweep(
    config: RunConfig, rates: Sequence[float], run_at: RunAt, refine: int = 2
) -> RunResult:
    """Run the points; the result is the best passing point's run (else the lowest rate's),
    with every point's summary in ``sweep``."""
    if not config.slos.any:
        raise ValueError("a sweep needs at least one SLO (--slo ttft:MS, itl:MS, tpot:MS, e2e:MS)")
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"sweep rates must be positive, got {list(rates)}")
    points: list[SweepPoint] = []

    async def measure(rate: float) -> SweepPoint:
        shape = LoadShape(
            Arrival.POISSON
            if config.shape.arrival in (Arrival.CONCURRENCY, Arrival.BURST)
            else config.shape.arrival,
            rate=rate,
            max_concurrency=(
                None
                if config.shape.arrival is Arrival.CONCURRENCY
                else config.shape.max_concurrency
            ),
            burstiness=config.shape.burstiness,
        )
        result = await run_at(config.with_shape(shape, f"{config.label}@{rate:g}"))
        point = SweepPoint(rate, result, result.summary.slo_attainment >= config.slo_attainment)
        points.append(point)
        return point

    passing: SweepPoint | None = None
    failing: SweepPoint | None = None
    for rate in sorted(rates):
        point = await measure(rate)
        if not point.meets_slos:
            failing = point
            break
        passing = point
    for _ in range(refine if passing and failing else 0):
        assert passing is not None
        assert failing is not None
        point = await measure((passing.rate + failing.rate) / 2)
        if point.meets_slos:
            passing = point
        else:
            failing = point
    best = passing or min(points, key=lambda p: p.rate)
    return dataclasses.replace(
        best.result,
        label=config.label,
        sweep=[p.to_dict() for p in sorted(points, key=lambda p: p.rate)],
    )

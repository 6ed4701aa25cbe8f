"""Figures of a run from its records: latency distributions, throughput, goodput, errors.

Warm-up records are excluded. Throughput divides by the measured duration: from the start of
the measured phase's schedule to its last answer (as vLLM's ``bench serve`` does). Goodput
counts completed requests meeting every SLO given:

- ``ttft``: the request's TTFT (vLLM's, first chunk);
- ``tpot``: its TPOT (vLLM's; 0 under two tokens, as in vLLM);
- ``itl``: its longest gap between chunks (a stream never stalls longer than this);
- ``e2e``: its end-to-end latency.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.harness.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)
SLO_NAMES = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True, slots=True)
class Stats:
    n: int
    mean: float
    std: float
    min: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats | None:
        data = np.fromiter(values, dtype=float)
        if data.size == 0:
            return None
        p50, p90, p95, p99 = np.percentile(data, PERCENTILES)
        return cls(
            n=int(data.size),
            mean=float(data.mean()),
            std=float(data.std()),
            min=float(data.min()),
            p50=float(p50),
            p90=float(p90),
            p95=float(p95),
            p99=float(p99),
            max=float(data.max()),
        )

    def to_dict(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class Slos:
    """Per-request service-level objectives in milliseconds (None: not checked)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, specs: Sequence[str]) -> Slos:
        """``["ttft:500", "itl:100"]`` (vLLM's ``--goodput`` syntax, plus ``itl``)."""
        values: dict[str, float] = {}
        for spec in specs:
            name, _, number = spec.partition(":")
            name = {"e2el": "e2e"}.get(name, name)
            try:
                value = float(number)
            except ValueError:
                value = -1.0
            if name not in SLO_NAMES or not value > 0:
                raise ValueError(
                    f"SLO {spec!r}: expected NAME:MILLISECONDS with NAME one of "
                    f"{', '.join(SLO_NAMES)} and a positive number, e.g. ttft:500"
                )
            values[f"{name}_ms"] = value
        return cls(**values)

    @property
    def any(self) -> bool:
        return any(v is not None for v in self.to_dict().values())

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        checks: list[tuple[float | None, float | None]] = [
            (self.ttft_ms, record.ttft_s),
            (self.tpot_ms, record.tpot_s or 0.0),
            (self.itl_ms, record.max_itl_s or 0.0),
            (self.e2e_ms, record.e2e_s),
        ]
        return all(
            limit is None or (value is not None and value * 1000 <= limit)
            for limit, value in checks
        )

    def to_dict(self) -> dict[str, float | None]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class Summary:
    sent: int
    completed: int
    failed: int
    malformed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    good: int
    goodput: float
    """Requests per second meeting every SLO (the request throughput when none is given)."""
    slo_attainment: float
    """Share of sent requests meeting every SLO."""
    metrics: dict[str, Stats | None]
    """Milliseconds: ttft, ttft_content, itl, tpot, ntpot, e2e, queue, schedule_lag."""
    errors_by_status: dict[str, int] = field(default_factory=dict)
    errors_by_type: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["metrics"] = {k: v.to_dict() if v else None for k, v in self.metrics.items()}
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Summary:
        values = dict(raw)
        values["metrics"] = {k: Stats(**v) if v else None for k, v in raw["metrics"].items()}
        return cls(**values)


def measured(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if not r.warmup]


def duration_of(records: Sequence[RequestRecord]) -> float:
    """The run's start (offset 0, when the schedule starts) to its last answer, in seconds.

    vLLM's benchmark duration: an open loop's wait for its first arrival counts too."""
    if not records:
        return 0.0
    return max(max(r.sent_s + r.elapsed_s for r in records), 1e-9)


def summarize(
    records: Sequence[RequestRecord], slos: Slos, duration_s: float | None = None
) -> Summary:
    """The figures for ``records`` (warm-up excluded); ``duration_s`` defaults to their span."""
    runs = measured(records)
    done = [r for r in runs if r.ok]
    duration = duration_s if duration_s is not None else duration_of(runs)
    good = sum(1 for r in done if slos.met_by(r))
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.completion_tokens or 0 for r in done)
    failed = [r for r in runs if not r.ok]

    def ms(
        values: Callable[[RequestRecord], float | None], pool: Sequence[RequestRecord]
    ) -> Stats | None:
        return Stats.of(v * 1000 for r in pool if (v := values(r)) is not None)

    metrics = {
        "ttft": ms(lambda r: r.ttft_s, done),
        "ttft_content": ms(lambda r: r.ttft_content_s, done),
        "itl": Stats.of(gap * 1000 for r in done for gap in r.itl_s),
        "tpot": ms(lambda r: r.tpot_s, done),
        "ntpot": ms(lambda r: r.ntpot_s, done),
        "e2e": ms(lambda r: r.e2e_s, done),
        "queue": Stats.of(r.queue_ms for r in runs if r.queue_ms is not None),
        "schedule_lag": ms(
            lambda r: r.sent_s - r.scheduled_s if r.scheduled_s is not None else None, runs
        ),
    }
    return Summary(
        sent=len(runs),
        completed=len(done),
        failed=len(failed),
        malformed=sum(1 for r in failed if r.error_type == "malformed"),
        duration_s=duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration if duration else math.nan,
        output_throughput=output_tokens / duration if duration else math.nan,
        total_token_throughput=(input_tokens + output_tokens) / duration if duration else math.nan,
        good=good,
        goodput=good / duration if duration else math.nan,
        slo_attainment=good / len(runs) if runs else 0.0,
        metrics=metrics,
        errors_by_status=dict(Counter(str(r.status) for r in failed)),
        errors_by_type=dict(Counter(r.error_type or "unknown" for r in failed)),
    )


def summarize_by_tenant(
    records: Sequence[RequestRecord], slos: Slos, duration_s: float
) -> dict[str, Summary]:
    """One summary per tenant over the run's whole duration (so throughputs add up)."""
    tenants = sorted({r.tenant for r in records})
    return {
        name: summarize([r for r in records if r.tenant == name], slos, duration_s)
        for name in tenants
    }

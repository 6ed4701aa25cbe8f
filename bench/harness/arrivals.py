"""Load shapes: when each request is sent.

- ``concurrency``: closed loop, a fixed number of requests in flight (``--concurrency``);
- ``constant``: evenly spaced at ``rate``, the first one interval after the start;
- ``poisson``: exponential gaps at ``rate``;
- ``gamma``: gamma gaps with ``burstiness`` (vLLM's ``--burstiness``: < 1 burstier, 1 is Poisson);
- ``burst``: ``burst_size`` requests at once every ``burst_interval_s``.

Random schedules are rescaled so the last arrival falls at N / rate, exactly as vLLM's
``bench serve`` does, so throughput does not drift with the seed. ``max_concurrency`` may cap any
open-loop shape too (vLLM's ``--max-concurrency``): a request then waits for a free slot, and its
latencies start when it is really sent.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np


class Arrival(enum.StrEnum):
    CONCURRENCY = "concurrency"
    CONSTANT = "constant"
    POISSON = "poisson"
    GAMMA = "gamma"
    BURST = "burst"


@dataclass(frozen=True, slots=True)
class LoadShape:
    arrival: Arrival
    rate: float = math.inf
    """Requests per second (open-loop shapes)."""
    max_concurrency: int | None = None
    burstiness: float = 1.0
    burst_size: int = 1
    burst_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.arrival is Arrival.CONCURRENCY:
            if not self.max_concurrency or self.max_concurrency < 1:
                raise ValueError("a closed-loop run needs --concurrency >= 1")
        elif self.arrival is Arrival.BURST:
            if self.burst_size < 1 or self.burst_interval_s <= 0:
                raise ValueError("bursts need --burst-size >= 1 and --burst-interval > 0")
        elif not self.rate > 0:
            raise ValueError(f"--rate must be > 0 for {self.arrival} arrivals, got {self.rate}")
        if self.arrival is Arrival.GAMMA and not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")

    @property
    def offered_rate(self) -> float:
        """Requests per second the shape offers (inf for a closed loop)."""
        if self.arrival is Arrival.CONCURRENCY:
            return math.inf
        if self.arrival is Arrival.BURST:
            return self.burst_size / self.burst_interval_s
        return self.rate

    def offsets(self, num_requests: int, rng: np.random.Generator) -> list[float | None]:
        """Send offsets in seconds from the start (None for every request of a closed loop)."""
        n = num_requests
        if n == 0:
            return []
        if self.arrival is Arrival.CONCURRENCY:
            return [None] * n
        if self.arrival is Arrival.BURST:
            return [(i // self.burst_size) * self.burst_interval_s for i in range(n)]
        if math.isinf(self.rate):
            return [0.0] * n  # vLLM's default rate: everything at once
        if self.arrival is Arrival.CONSTANT:
            return [(i + 1) / self.rate for i in range(n)]  # vLLM's burstiness=inf schedule
        shape = 1.0 if self.arrival is Arrival.POISSON else self.burstiness
        gaps = rng.gamma(shape=shape, scale=1.0 / (self.rate * shape), size=n)
        times = np.cumsum(gaps)
        times *= (n / self.rate) / times[-1]
        return [float(t) for t in times]

    def describe(self) -> str:
        if self.arrival is Arrival.CONCURRENCY:
            return f"concurrency {self.max_concurrency}"
        if self.arrival is Arrival.BURST:
            text = f"bursts of {self.burst_size} every {self.burst_interval_s:g} s"
        else:
            text = f"{self.arrival} {self.rate:g} req/s"
            if self.arrival is Arrival.GAMMA:
                text += f" (burstiness {self.burstiness:g})"
        if self.max_concurrency:
            text += f", at most {self.max_concurrency} in flight"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "arrival": str(self.arrival),
            "rate": None if math.isinf(self.rate) else self.rate,
            "max_concurrency": self.max_concurrency,
            "burstiness": self.burstiness,
            "burst_size": self.burst_size,
            "burst_interval_s": self.burst_interval_s,
        }

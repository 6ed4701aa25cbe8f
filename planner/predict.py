"""The next interval's load from the intervals seen so far.

``ConstantPredictor`` says the next interval looks like the last (a reactive planner).
``TrendPredictor`` is Holt's double exponential smoothing: a smoothed level plus a smoothed
trend, so a ramp is met one interval ahead rather than one behind; never below zero. Both start
from the first observation: a cold start is not a trend (Dynamo's planner over-scales decode on
its cold-start samples).
"""

from __future__ import annotations

from typing import Protocol


class Predictor(Protocol):
    def observe(self, value: float) -> None:
        """The value one interval ended with."""
        ...

    def predict(self) -> float:
        """The next interval's value (0 before any observation)."""
        ...


class ConstantPredictor:
    def __init__(self) -> None:
        self._last = 0.0

    def observe(self, value: float) -> None:
        self._last = value

    def predict(self) -> float:
        return self._last


class TrendPredictor:
    """Holt's linear method; ``alpha`` weighs the newest level, ``beta`` the newest trend."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        if not (0 < alpha <= 1 and 0 <= beta <= 1):
            raise ValueError(f"need 0 < alpha <= 1 and 0 <= beta <= 1, got {alpha}, {beta}")
        self._alpha, self._beta = alpha, beta
        self._level: float | None = None
        self._trend = 0.0

    def observe(self, value: float) -> None:
        if self._level is None:
            self._level = value  # no trend from a single point
            return
        previous = self._level
        self._level = self._alpha * value + (1 - self._alpha) * (previous + self._trend)
        self._trend = self._beta * (self._level - previous) + (1 - self._beta) * self._trend

    def predict(self) -> float:
        if self._level is None:
            return 0.0
        return max(0.0, self._level + self._trend)

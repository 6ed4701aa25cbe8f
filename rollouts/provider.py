"""Where gates read their figures: a small interface, and its in-gateway implementation.

``MetricsProvider`` answers "what did this version do over the last ``window_s`` seconds" as
``gates.VersionFigures``. ``WindowsProvider`` reads the gateway's own sliding windows
(``traffic.windows``), its cost meter and its shadow comparisons: the embedded default, and
what a single gateway judges by. With several gateways the lease holder reads its own
replica's windows: a share of the traffic drawn the same way on every replica (the load
balancer spreads requests, the policy splits them), so the same comparison on fewer samples.
``rollouts.provider_prometheus.PrometheusProvider`` (PromQL over every replica's ``/metrics``,
``TANDEM_ROLLOUT_PROMETHEUS_URL``) implements the same interface for all of the traffic.

A provider that cannot answer raises ``MetricsUnavailable``: the gates then measure ``error``,
which holds the step and never promotes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Literal, Protocol

from rollouts.gates import VersionFigures

if TYPE_CHECKING:
    from billing.cost import CostFigure
    from traffic.windows import VersionWindows


class MetricsUnavailable(Exception):
    """The metric source could not answer; the message says which and why."""


class MetricsProvider(Protocol):
    async def figures(
        self, version: str, window_s: float, *, shadow: bool = False
    ) -> VersionFigures:
        """``version``'s figures over the last ``window_s`` seconds: of the traffic it served,
        or (``shadow``) of the copies it answered. ``MetricsUnavailable`` if unknown."""
        ...

    async def samples(
        self, version: str, window_s: float, figure: Literal["ttft", "itl"]
    ) -> list[float]:
        """The latency samples behind ``figures`` (seconds), for the report's plots."""
        ...


CostSource = Callable[[str, float], "CostFigure | None"]
"""(version, window_s) -> its measured cost over the window; None: nothing priced."""
AgreementSource = Callable[[str, float], tuple[int, int]]
"""(shadow version, window_s) -> (answers compared, answers that agreed)."""


class WindowsProvider:
    """The gateway's own figures (see the module docstring)."""

    def __init__(
        self,
        windows: VersionWindows,
        cost: CostSource | None = None,
        agreement: AgreementSource | None = None,
    ) -> None:
        self._windows = windows
        self._cost = cost
        self._agreement = agreement

    def _window(self, window_s: float) -> float:
        # A phase older than the windows' horizon is judged over the horizon.
        return min(max(window_s, 1e-3), self._windows.horizon_s)

    async def figures(
        self, version: str, window_s: float, *, shadow: bool = False
    ) -> VersionFigures:
        window_s = self._window(window_s)
        windows = self._windows
        snapshot = windows.snapshot(version, window_s, shadow=shadow)
        cost = None if self._cost is None or shadow else self._cost(version, window_s)
        figures = VersionFigures.from_window(
            snapshot,
            windows.samples(version, window_s, "ttft", shadow=shadow),
            windows.samples(version, window_s, "itl", shadow=shadow),
            cost,
        )
        if shadow and self._agreement is not None:
            compared, same = self._agreement(version, window_s)
            figures = _with_agreement(figures, compared, same)
        return figures

    async def samples(
        self, version: str, window_s: float, figure: Literal["ttft", "itl"]
    ) -> list[float]:
        return self._windows.samples(version, self._window(window_s), figure)


def _with_agreement(figures: VersionFigures, compared: int, same: int) -> VersionFigures:
    return replace(figures, shadow_compared=compared, shadow_same=same)

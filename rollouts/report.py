"""A finished rollout's report: two PNGs, a markdown decision log and the data behind them.

``write_report`` writes into one folder:

- ``latency.png``: empirical CDFs of TTFT (left) and ITL (right), baseline against candidate,
  each version's nearest-rank p95 (as the gates compute it) a dashed vertical line in its colour
  and its sample count in the legend. A panel without samples says so in its title.
- ``weights.png``: the candidate's traffic weight (%) over time as a step plot, x in seconds
  since the first point, each decision a vertical line labelled with its event (``failed`` and
  ``rolled_back`` in red).
- ``decisions.md``: the rollout (alias, versions, status), then one line per decision (UTC time,
  event, weight, detail) and, under a decision that took measurements, a table of them.
- ``report.json``: ``ReportData.to_dict()``; ``ReportData.from_dict`` reads it back.

Figures are ``matplotlib.figure.Figure`` objects saved with the Agg renderer, never through
``pyplot`` (as ``bench.harness.plots`` does): no global figure registry for an unclosed figure to
leak from, no GUI backend to pick. matplotlib is imported inside ``write_report`` because it
takes about a second to import and only reports need it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollouts.stats import percentile

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["ReportData", "decision_log", "write_report"]

RED_EVENTS = frozenset({"failed", "rolled_back"})
"""Decision events drawn in red on ``weights.png``."""

LATENCY_PNG = "latency.png"
WEIGHTS_PNG = "weights.png"
DECISIONS_MD = "decisions.md"
REPORT_JSON = "report.json"

_BASELINE_COLOUR = "tab:blue"
_CANDIDATE_COLOUR = "tab:orange"


@dataclass(frozen=True, slots=True)
class ReportData:
    """What a report shows of one rollout."""

    rollout_id: str
    alias: str
    baseline: str
    """The baseline version's name (a key of ``ttft_s`` and ``itl_s``)."""
    candidate: str
    status: str
    """How the rollout ended (``succeeded``, ``rolled_back``, ``aborted``...)."""
    weights: tuple[tuple[float, float], ...]
    """``(unix time, candidate weight %)`` at each change, oldest first; weights 0 to 100."""
    decisions: tuple[Mapping[str, Any], ...]
    """Oldest first. Each has ``at`` (unix time), ``event`` and ``detail``; it may have
    ``weight`` (%) and ``measurements`` (``Measurement.to_dict()`` each)."""
    ttft_s: Mapping[str, Sequence[float]]
    """Version name -> time-to-first-token samples, seconds (may be empty)."""
    itl_s: Mapping[str, Sequence[float]]
    """Version name -> inter-token latency samples, seconds (may be empty)."""

    def __post_init__(self) -> None:
        for when, weight in self.weights:
            if not (math.isfinite(when) and math.isfinite(weight) and 0 <= weight <= 100):
                raise ValueError(
                    f"weights: ({when!r}, {weight!r}) must be a finite unix time and a "
                    "candidate weight between 0 and 100 %"
                )
        for i, decision in enumerate(self.decisions):
            missing = [key for key in ("at", "event", "detail") if key not in decision]
            if missing:
                raise ValueError(f"decisions[{i}] lacks {', '.join(missing)}: each needs all three")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (lists for tuples, dicts for mappings)."""
        return {
            "rollout_id": self.rollout_id,
            "alias": self.alias,
            "baseline": self.baseline,
            "candidate": self.candidate,
            "status": self.status,
            "weights": [[when, weight] for when, weight in self.weights],
            "decisions": [_plain(decision) for decision in self.decisions],
            "ttft_s": {name: list(samples) for name, samples in self.ttft_s.items()},
            "itl_s": {name: list(samples) for name, samples in self.itl_s.items()},
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ReportData:
        """The inverse of ``to_dict`` (what ``report.json`` holds)."""
        return cls(
            rollout_id=raw["rollout_id"],
            alias=raw["alias"],
            baseline=raw["baseline"],
            candidate=raw["candidate"],
            status=raw["status"],
            weights=tuple((float(when), float(weight)) for when, weight in raw["weights"]),
            decisions=tuple(raw["decisions"]),
            ttft_s={name: tuple(samples) for name, samples in raw["ttft_s"].items()},
            itl_s={name: tuple(samples) for name, samples in raw["itl_s"].items()},
        )


def _plain(value: Any) -> Any:
    """Mappings and sequences as dicts and lists, all the way down."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def write_report(data: ReportData, folder: Path) -> list[Path]:
    """Write ``latency.png``, ``weights.png``, ``decisions.md`` and ``report.json`` into
    ``folder`` (created if missing, files replaced) and return their paths in that order.

    Blocking (file I/O, rendering takes a second or so): from async code, run it in a thread
    (``await asyncio.to_thread(write_report, data, folder)``).
    """
    folder.mkdir(parents=True, exist_ok=True)
    paths = [
        _latency(data, folder / LATENCY_PNG),
        _weights(data, folder / WEIGHTS_PNG),
        folder / DECISIONS_MD,
        folder / REPORT_JSON,
    ]
    paths[2].write_text(decision_log(data), encoding="utf-8")
    # default=str: a figure of no JSON type (a Decimal cost) is written as its text, not refused.
    paths[3].write_text(json.dumps(data.to_dict(), indent=2, default=str) + "\n", encoding="utf-8")
    return paths


def _figure(num_panels: int, width: float) -> tuple[Figure, list[Axes]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 5), layout="constrained")
    return fig, [fig.add_subplot(1, num_panels, i + 1) for i in range(num_panels)]


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120, format="png")
    # No pyplot, so nothing holds the figure once saved; clearing frees its artists now.
    fig.clear()
    return path


def _latency(data: ReportData, path: Path) -> Path:
    fig, axes = _figure(2, 13)
    for ax, name, samples in zip(axes, ("TTFT", "ITL"), (data.ttft_s, data.itl_s), strict=True):
        _cdf_panel(ax, name, data, samples)
    return _save(fig, path)


def _cdf_panel(
    ax: Axes, name: str, data: ReportData, samples: Mapping[str, Sequence[float]]
) -> None:
    """One metric's CDFs in milliseconds, with each version's p95 dashed."""
    sides = (
        ("baseline", data.baseline, _BASELINE_COLOUR),
        ("candidate", data.candidate, _CANDIDATE_COLOUR),
    )
    drawn = 0
    for role, version, colour in sides:
        values = sorted(value * 1000 for value in samples.get(version, ()))
        if not values:
            # An empty line keeps the version in the legend, saying it had no samples.
            ax.plot([], [], color=colour, label=f"{role} {version} (n=0)")
            continue
        drawn += 1
        p95 = percentile(values, 95)
        ys = [(i + 1) / len(values) for i in range(len(values))]
        # Start at 0 so a one-valued sample still draws its step.
        ax.step(
            [values[0], *values],
            [0.0, *ys],
            where="post",
            color=colour,
            label=f"{role} {version} (n={len(values)}, p95 {p95:.1f} ms)",
        )
        ax.axvline(p95, color=colour, linestyle="--", linewidth=1)
    title = f"{name}: empirical CDF, p95 dashed"
    if drawn == 0:
        title = f"{name}: no samples for either version"
    elif drawn == 1:
        title = f"{name}: empirical CDF, p95 dashed (one version has no samples)"
    ax.set(title=title, xlabel=f"{name} (ms)", ylabel="fraction of samples <= x", ylim=(0, 1.02))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")


def _weights(data: ReportData, path: Path) -> Path:
    fig, [ax] = _figure(1, 11)
    starts = [when for when, _ in data.weights[:1]] + [float(d["at"]) for d in data.decisions[:1]]
    origin = min(starts) if starts else 0.0
    if data.weights:
        xs = [when - origin for when, _ in data.weights]
        ys = [weight for _, weight in data.weights]
        # The last weight holds to the last decision (the end of the rollout), if later.
        end = max([xs[-1], *(float(d["at"]) - origin for d in data.decisions)])
        ax.step([*xs, end], [*ys, ys[-1]], where="post", color=_CANDIDATE_COLOUR, linewidth=2)
        title = f"{data.alias}: {data.candidate}'s traffic weight ({data.status})"
    else:
        title = f"{data.alias}: no weight points recorded ({data.status})"
    for decision in data.decisions:
        x = float(decision["at"]) - origin
        event = str(decision["event"])
        colour = "tab:red" if event in RED_EVENTS else "tab:gray"
        ax.axvline(x, color=colour, linestyle=":", linewidth=1)
        # Labels in axes coordinates vertically: they stay inside whatever the y range.
        ax.text(
            x, 0.98, f" {event}", transform=ax.get_xaxis_transform(), rotation=90,
            ha="right", va="top", fontsize=8, color=colour,
        )  # fmt: skip
    ax.set(
        title=title,
        xlabel="seconds since the rollout's first point",
        ylabel=f"{data.candidate} weight (%)",
        ylim=(-2, 105),
    )
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def decision_log(data: ReportData) -> str:
    """``decisions.md``: the rollout, then each decision and its measurements."""
    lines = [
        f"# Rollout {data.rollout_id}: {data.alias}",
        "",
        f"- Baseline: `{data.baseline}`",
        f"- Candidate: `{data.candidate}`",
        f"- Status: **{data.status}**",
        "",
        "## Decisions",
        "",
    ]
    if not data.decisions:
        lines.append("No decisions recorded.")
    for decision in data.decisions:
        when = datetime.fromtimestamp(float(decision["at"]), UTC).strftime("%Y-%m-%d %H:%M:%S")
        weight = decision.get("weight")
        said = f"weight {weight:g} %" if isinstance(weight, int | float) else "weight -"
        lines.append(f"- {when} UTC · **{decision['event']}** · {said} · {decision['detail']}")
        measurements = decision.get("measurements") or ()
        if measurements:
            lines += ["", *_measurement_table(measurements), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _measurement_table(measurements: Sequence[Mapping[str, Any]]) -> list[str]:
    """Indented under its decision's list item, so markdown keeps it with the decision."""
    rows = [
        "| gate | verdict | candidate | baseline | samples | detail |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for m in measurements:
        gate = m.get("gate") or {}
        kind = str(gate.get("kind", "?")) + (" (dry run)" if gate.get("dry_run") else "")
        cells = [
            kind,
            str(m.get("verdict", "?")),
            _number(m.get("candidate_value")),
            _number(m.get("baseline_value")),
            _number(m.get("num_samples")),
            str(m.get("detail", "")),
        ]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return ["  " + row for row in rows]


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)

"""PNG plots of a run: latency CDFs, tenants side by side, latency against offered load.

Figures are built as ``matplotlib.figure.Figure`` objects and saved with the Agg renderer,
never through ``pyplot``: no global figure registry to leak from, no GUI backend to pick, and
nothing changes for other code in the process (matplotlib's advice for non-interactive use).
matplotlib is imported inside the functions because it takes about a second to import and only
``--plots`` needs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bench.harness.records import RequestRecord
from bench.harness.report import fmt_ms, highest_passing_rate, slo_limits, sweep_rows
from bench.harness.result import RunResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_comparison", "plot_result"]

Series = list[tuple[str, list[float]]]
"""Named samples in milliseconds, one line each."""

TENANT_BARS = (("ttft", "p50"), ("ttft", "p99"), ("itl", "p50"), ("itl", "p99"), ("e2e", "p50"))
LOAD_LINES = (
    ("ttft", "p50", "-"),
    ("ttft", "p99", "--"),
    ("itl", "p50", "-"),
    ("itl", "p99", "--"),
    ("e2e", "p50", "-"),
)
ALL_TENANTS = "all tenants"
COLOURS = {"ttft": "tab:blue", "itl": "tab:orange", "e2e": "tab:green"}


def _figure() -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), layout="constrained")
    return fig, fig.add_subplot()


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120, format="png")
    return path


def _ttfts(records: Sequence[RequestRecord]) -> list[float]:
    return [r.ttft_s * 1000 for r in records if r.ok and r.ttft_s is not None]


def _gaps(records: Sequence[RequestRecord]) -> list[float]:
    return [gap * 1000 for r in records if r.ok for gap in r.itl_s]


def _by_tenant(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    """Measured records per tenant, after one line for all of them when there are several."""
    runs = [r for r in records if not r.warmup]
    tenants = sorted({r.tenant for r in runs})
    if len(tenants) < 2:
        return {"all": runs}
    per_tenant = {f"tenant {name}": [r for r in runs if r.tenant == name] for name in tenants}
    return {ALL_TENANTS: runs} | per_tenant


def _cdf(path: Path, series: Series, title: str, xlabel: str) -> Path | None:
    """Empirical CDFs; log x when the samples span two decades (long tails stay readable)."""
    series = [(name, values) for name, values in series if values]
    if not series:
        return None
    fig, ax = _figure()
    for name, values in series:
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        # Start at 0 so a one-valued sample still draws its step; the overall line stays black.
        overall = name == ALL_TENANTS
        ax.step(
            [xs[0], *xs],
            [0.0, *ys],
            where="post",
            label=f"{name} (n={len(xs)})",
            color="black" if overall else None,
            linewidth=2 if overall else None,
        )
    low = min(min(v) for _, v in series)
    high = max(max(v) for _, v in series)
    if low > 0 and high / low > 100:
        ax.set_xscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel="fraction of samples <= x", ylim=(0, 1.02))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def _tenant_bars(result: RunResult, path: Path) -> Path:
    fig, ax = _figure()
    tenants = sorted(result.tenants)
    width = 0.8 / len(tenants)
    for i, name in enumerate(tenants):
        metrics = result.tenants[name].metrics
        heights = [
            float(getattr(stats, stat)) if (stats := metrics.get(metric)) else math.nan
            for metric, stat in TENANT_BARS
        ]
        xs = [j + (i - (len(tenants) - 1) / 2) * width for j in range(len(TENANT_BARS))]
        bars = ax.bar(xs, heights, width, label=name)
        ax.bar_label(bars, labels=[fmt_ms(h) for h in heights], fontsize=7)
    ax.set_xticks(range(len(TENANT_BARS)), [f"{m} {s}" for m, s in TENANT_BARS])
    ax.set_yscale("log")
    ax.set(title=f"{result.label}: latency by tenant", ylabel="latency (ms, log scale)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _latency_vs_load(result: RunResult, path: Path) -> Path | None:
    rows = [row for row in sweep_rows(result) if math.isfinite(row.rate)]
    if not rows:
        return None
    fig, ax = _figure()
    rates = [row.rate for row in rows]
    for metric, stat, style in LOAD_LINES:
        values = [
            float(getattr(stats, stat)) if (stats := row.summary.metrics.get(metric)) else math.nan
            for row in rows
        ]
        ax.plot(rates, values, style, marker="o", color=COLOURS[metric], label=f"{metric} {stat}")
    for metric, limit in slo_limits(result).items():
        colour = COLOURS.get(metric, "tab:gray")
        ax.axhline(limit, color=colour, linestyle=":", linewidth=1.5, label=f"{metric} SLO")
    best = highest_passing_rate(rows)
    if best is not None:
        ax.axvline(best, color="black", linestyle="-.", linewidth=1)
        ax.annotate(
            f"highest rate meeting SLOs: {best:g} req/s",
            (best, 0.98),
            xycoords=("data", "axes fraction"),
            xytext=(-4, 0),
            textcoords="offset points",
            ha="right",
            va="top",
            rotation=90,
            fontsize=8,
        )
    ax.set_yscale("log")
    ax.set(
        title=f"{result.label}: latency against offered load",
        xlabel="offered load (req/s)",
        ylabel="latency (ms, log scale)",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_result(result: RunResult, out_dir: Path) -> list[Path]:
    """The plots that apply to ``result`` (warm-up excluded); returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = _by_tenant(result.records)
    written = [
        _cdf(
            out_dir / "ttft_cdf.png",
            [(name, _ttfts(rs)) for name, rs in groups.items()],
            f"{result.label}: time to first token",
            "TTFT (ms)",
        ),
        _cdf(
            out_dir / "itl_cdf.png",
            [(name, _gaps(rs)) for name, rs in groups.items()],
            f"{result.label}: inter-token latency (every chunk gap)",
            "ITL (ms)",
        ),
    ]
    if len(result.tenants) > 1:
        written.append(_tenant_bars(result, out_dir / "tenants.png"))
    if result.sweep:
        written.append(_latency_vs_load(result, out_dir / "latency_vs_load.png"))
    return [path for path in written if path is not None]


def plot_comparison(a: RunResult, b: RunResult, out_dir: Path) -> list[Path]:
    """TTFT and ITL CDFs of two runs on shared axes (warm-up excluded)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = (a.label, b.label) if a.label != b.label else (f"A: {a.label}", f"B: {b.label}")
    runs = [[r for r in result.records if not r.warmup] for result in (a, b)]
    title = f"{names[0]} vs {names[1]}"
    written = [
        _cdf(
            out_dir / "compare_ttft_cdf.png",
            [(name, _ttfts(rs)) for name, rs in zip(names, runs, strict=True)],
            f"{title}: time to first token",
            "TTFT (ms)",
        ),
        _cdf(
            out_dir / "compare_itl_cdf.png",
            [(name, _gaps(rs)) for name, rs in zip(names, runs, strict=True)],
            f"{title}: inter-token latency",
            "ITL (ms)",
        ),
    ]
    return [path for path in written if path is not None]

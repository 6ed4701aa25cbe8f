"""A run's figures on the terminal: headline, latency percentiles, tenants and sweep points.

Everything is read from the saved ``RunResult`` (never from live state), so a result file
printed later looks exactly like the run did. The config is a free-form dict: every field of it
is optional here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from bench.harness.result import RunResult
from bench.harness.summary import Stats, Summary

__all__ = [
    "DEFINITIONS",
    "LATENCY_METRICS",
    "SweepRow",
    "fmt_ms",
    "highest_passing_rate",
    "print_result",
    "slo_limits",
    "summary_table",
    "sweep_rows",
    "sweep_table",
    "tenant_table",
]

DEFINITIONS = (
    "TTFT/ITL/TPOT as vLLM bench serve: TTFT to first chunk, ITL per chunk gap, "
    "TPOT excludes first token"
)
LATENCY_METRICS = (
    "ttft",
    "ttft_content",
    "itl",
    "tpot",
    "ntpot",
    "e2e",
    "queue",
    "schedule_lag",
)
"""Row order of the latency table; a metric without data (e.g. no ``queue``) is left out."""


@dataclass(frozen=True, slots=True)
class SweepRow:
    """One sweep point, parsed once so the table and the plot agree."""

    rate: float
    summary: Summary
    meets_slos: bool


def fmt_ms(value: float | None) -> str:
    """Milliseconds with precision that fits the magnitude (sub-ms ITLs, multi-second E2Es)."""
    if value is None or math.isnan(value):
        return "-"
    if abs(value) < 10:
        return f"{value:.2f}"
    if abs(value) < 1000:
        return f"{value:.1f}"
    return f"{value:.0f}"


def _rate(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def _pct(share: float) -> str:
    return f"{share * 100:.1f}%"


def _stat(summary: Summary, metric: str, name: str) -> float | None:
    stats = summary.metrics.get(metric)
    return None if stats is None else float(getattr(stats, name))


def slo_limits(result: RunResult) -> dict[str, float]:
    """The SLOs the run checked, ``{"ttft": 500.0, ...}`` in ms (empty when none given)."""
    raw = result.config.get("slos") or {}
    return {
        name.removesuffix("_ms"): float(limit)
        for name, limit in raw.items()
        if isinstance(limit, int | float)
    }


def sweep_rows(result: RunResult) -> list[SweepRow]:
    """The sweep points by offered rate (a JSON null rate, i.e. unbounded, reads as inf)."""
    rows = [
        SweepRow(
            rate=math.inf if point.get("rate") is None else float(point["rate"]),
            summary=Summary.from_dict(point["summary"]),
            meets_slos=bool(point.get("meets_slos")),
        )
        for point in result.sweep
    ]
    return sorted(rows, key=lambda row: row.rate)


def highest_passing_rate(rows: list[SweepRow]) -> float | None:
    passing = [row.rate for row in rows if row.meets_slos]
    return max(passing) if passing else None


def _headline(result: RunResult) -> Table:
    summary = result.summary
    config = result.config
    target = config.get("target") or {}
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("run", escape(f"{result.label}  ({result.started_at})"))
    table.add_row("metrics", f"[dim]{DEFINITIONS}[/]")
    where = target.get("url") or target.get("base_url")
    if where or target.get("model"):
        api = f", {target['api']} API" if target.get("api") else ""
        table.add_row("target", escape(f"{where or '?'}, model {target.get('model', '?')}{api}"))
    if config.get("shape_description"):
        table.add_row("load", escape(str(config["shape_description"])))
    table.add_row("duration", f"{summary.duration_s:.2f} s")
    table.add_row(
        "requests",
        f"sent {summary.sent}, completed {summary.completed}, failed {summary.failed}"
        f" (malformed {summary.malformed})",
    )
    table.add_row(
        "throughput",
        f"{_rate(summary.request_throughput)} req/s, "
        f"{_rate(summary.output_throughput)} output tok/s, "
        f"{_rate(summary.total_token_throughput)} total tok/s",
    )
    table.add_row("tokens", f"{summary.total_input_tokens} in, {summary.total_output_tokens} out")
    limits = slo_limits(result)
    if limits:
        slos = ", ".join(f"{name} <= {limit:g} ms" for name, limit in limits.items())
        table.add_row(
            "goodput",
            f"{_rate(summary.goodput)} req/s ({summary.good} good); "
            f"SLO attainment {_pct(summary.slo_attainment)} with {slos}",
        )
    return table


def _latency(summary: Summary) -> Table:
    table = Table(title="latency (ms)", title_justify="left")
    table.add_column("metric")
    for name in ("n", "mean", "p50", "p90", "p95", "p99", "max"):
        table.add_column(name, justify="right")
    for metric in LATENCY_METRICS:
        stats: Stats | None = summary.metrics.get(metric)
        if stats is None:
            continue
        values = (stats.mean, stats.p50, stats.p90, stats.p95, stats.p99, stats.max)
        table.add_row(metric, str(stats.n), *(fmt_ms(v) for v in values))
    return table


def _errors(summary: Summary) -> Table:
    table = Table(title="errors", title_justify="left")
    table.add_column("by")
    table.add_column("value")
    table.add_column("count", justify="right")
    for status, count in sorted(summary.errors_by_status.items()):
        table.add_row("status", "no response" if status == "None" else escape(status), str(count))
    for kind, count in sorted(summary.errors_by_type.items()):
        table.add_row("type", escape(kind), str(count))
    return table


def summary_table(result: RunResult) -> Group:
    """The headline, the latency percentiles and (when any failed) the errors."""
    parts: list[Table] = [_headline(result), _latency(result.summary)]
    if result.summary.failed:
        parts.append(_errors(result.summary))
    return Group(*parts)


def tenant_table(result: RunResult) -> Table:
    """One row per tenant: what a fairness comparison between tenants needs at a glance."""
    with_slos = bool(slo_limits(result))
    table = Table(
        title=escape(f"tenants of {result.label} (latencies in ms)"), title_justify="left"
    )
    columns = ["tenant", "sent", "ok", "failed", "req/s", "out tok/s"]
    columns += ["ttft p50", "ttft p99", "itl p50", "itl p99", "tpot p50", "e2e p50", "e2e p99"]
    if with_slos:
        columns += ["goodput", "attainment"]
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    latencies = (
        ("ttft", "p50"),
        ("ttft", "p99"),
        ("itl", "p50"),
        ("itl", "p99"),
        ("tpot", "p50"),
        ("e2e", "p50"),
        ("e2e", "p99"),
    )
    for tenant, summary in sorted(result.tenants.items()):
        cells = [escape(tenant), str(summary.sent), str(summary.completed), str(summary.failed)]
        cells += [_rate(summary.request_throughput), _rate(summary.output_throughput)]
        cells += [fmt_ms(_stat(summary, metric, name)) for metric, name in latencies]
        if with_slos:
            cells += [_rate(summary.goodput), _pct(summary.slo_attainment)]
        table.add_row(*cells)
    return table


def sweep_table(result: RunResult) -> Table:
    """One row per offered rate; the caption names the highest rate meeting the SLOs."""
    rows = sweep_rows(result)
    table = Table(title=escape(f"sweep of {result.label} (latencies in ms)"), title_justify="left")
    columns = ["offered req/s", "achieved req/s", "ttft p50", "ttft p99", "itl p50"]
    columns += ["itl p99", "tpot p50", "e2e p99", "attainment", "meets SLOs"]
    for name in columns:
        table.add_column(name, justify="right")
    for row in rows:
        s = row.summary
        table.add_row(
            f"{row.rate:g}",
            _rate(s.request_throughput),
            fmt_ms(_stat(s, "ttft", "p50")),
            fmt_ms(_stat(s, "ttft", "p99")),
            fmt_ms(_stat(s, "itl", "p50")),
            fmt_ms(_stat(s, "itl", "p99")),
            fmt_ms(_stat(s, "tpot", "p50")),
            fmt_ms(_stat(s, "e2e", "p99")),
            _pct(s.slo_attainment),
            "[green]yes[/]" if row.meets_slos else "[red]no[/]",
        )
    best = highest_passing_rate(rows)
    needed = result.config.get("slo_attainment")
    share = f" (at least {_pct(float(needed))} of requests within them)" if needed else ""
    table.caption = (
        f"highest rate meeting the SLOs: {best:g} req/s{share}"
        if best is not None
        else f"no rate met the SLOs{share}"
    )
    return table


def print_result(result: RunResult, console: Console) -> None:
    """Everything that applies to this result: summary, tenants (if several), sweep (if any)."""
    console.print(summary_table(result))
    if len(result.tenants) > 1:
        console.print(tenant_table(result))
    if result.sweep:
        console.print(sweep_table(result))

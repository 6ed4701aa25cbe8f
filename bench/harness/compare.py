"""``tandem bench compare A.json B.json``: what changed from run A to run B.

Every figure is a ``Difference`` that knows which way is better (lower latencies, higher
throughput), so the table can colour a regression red without the reader knowing each metric.
Ratios within 5 % stay uncoloured: run-to-run noise of a benchmark is of that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench.harness.report import LATENCY_METRICS
from bench.harness.result import RunResult
from bench.harness.summary import Summary

__all__ = ["NOISE", "Difference", "compare", "compare_files", "comparison_table"]

NOISE = 0.05
"""Ratios closer than this to 1 are not coloured as better or worse."""
LATENCY_STATS = ("p50", "p90", "p99", "mean")
TENANT_METRICS = ("ttft", "itl", "e2e")


@dataclass(frozen=True, slots=True)
class Difference:
    metric: str
    a: float | None
    b: float | None
    higher_is_better: bool | None = None
    """True for throughputs, False for latencies and failures, None for neutral counts."""

    @property
    def delta(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a

    @property
    def ratio(self) -> float | None:
        """B / A (None when either is missing or A is 0)."""
        return None if self.a is None or self.b is None or self.a == 0 else self.b / self.a

    @property
    def better(self) -> bool | None:
        """Whether B improves on A (None for a neutral metric or a missing value)."""
        delta = self.delta
        if self.higher_is_better is None or delta is None:
            return None
        return delta > 0 if self.higher_is_better else delta < 0


def _stat(summary: Summary, metric: str, stat: str) -> float | None:
    stats = summary.metrics.get(metric)
    return None if stats is None else float(getattr(stats, stat))


def compare(a: RunResult, b: RunResult) -> list[Difference]:
    """Counts, throughputs, goodput and latency percentiles of both runs, then shared tenants."""
    sa, sb = a.summary, b.summary
    diffs = [
        Difference("sent", sa.sent, sb.sent),
        Difference("completed", sa.completed, sb.completed),
        Difference("failed", sa.failed, sb.failed, higher_is_better=False),
        Difference("malformed", sa.malformed, sb.malformed, higher_is_better=False),
        Difference("input tokens", sa.total_input_tokens, sb.total_input_tokens),
        Difference("output tokens", sa.total_output_tokens, sb.total_output_tokens),
    ]
    rates = (
        ("request throughput (req/s)", "request_throughput"),
        ("output throughput (tok/s)", "output_throughput"),
        ("total token throughput (tok/s)", "total_token_throughput"),
        ("goodput (req/s)", "goodput"),
    )
    for name, field in rates:
        diffs.append(Difference(name, getattr(sa, field), getattr(sb, field), True))
    diffs.append(
        Difference("slo attainment (%)", sa.slo_attainment * 100, sb.slo_attainment * 100, True)
    )
    for metric in LATENCY_METRICS:
        if sa.metrics.get(metric) is None and sb.metrics.get(metric) is None:
            continue
        for stat in LATENCY_STATS:
            diffs.append(
                Difference(
                    f"{metric} {stat} (ms)",
                    _stat(sa, metric, stat),
                    _stat(sb, metric, stat),
                    higher_is_better=False,
                )
            )
    # With one tenant on either side its rows would only repeat the overall ones.
    if len(a.tenants) > 1 or len(b.tenants) > 1:
        for tenant in sorted(a.tenants.keys() & b.tenants.keys()):
            for metric in TENANT_METRICS:
                diffs.append(
                    Difference(
                        f"tenant {tenant}: {metric} p50 (ms)",
                        _stat(a.tenants[tenant], metric, "p50"),
                        _stat(b.tenants[tenant], metric, "p50"),
                        higher_is_better=False,
                    )
                )
    return diffs


def _numbers(diff: Difference) -> list[str]:
    """A, B and delta at one precision per row, chosen by the row's magnitude."""
    values = [v for v in (diff.a, diff.b) if v is not None]
    if all(isinstance(v, int) for v in values):
        decimals = 0  # a count
    else:
        largest = max((abs(v) for v in values), default=0.0)
        decimals = 2 if largest < 10 else 1 if largest < 1000 else 0
    cells = [f"{v:.{decimals}f}" if v is not None else "-" for v in (diff.a, diff.b)]
    delta = diff.delta
    return [*cells, "-" if delta is None else f"{delta:+.{decimals}f}"]


def _ratio(diff: Difference) -> str:
    ratio = diff.ratio
    if ratio is None:
        return "-"
    text = f"{ratio:.2f}x"
    if abs(ratio - 1) <= NOISE or diff.better is None:
        return text
    return f"[green]{text}[/]" if diff.better else f"[red]{text}[/]"


def comparison_table(
    a: RunResult, b: RunResult, diffs: list[Difference], names: tuple[str, str] | None = None
) -> Table:
    """The differences as a table; ``names`` (e.g. the files) are added to the caption."""
    where = names or ("", "")
    label_a = f"{a.label} ({where[0]})" if where[0] else a.label
    label_b = f"{b.label} ({where[1]})" if where[1] else b.label
    table = Table(
        title=escape(f"A: {label_a}  vs  B: {label_b}"),
        title_justify="left",
        caption=f"ratio B/A: green better, red worse by more than {NOISE:.0%}",
    )
    table.add_column("metric")
    for column in ("A", "B", "delta", "ratio B/A"):
        table.add_column(column, justify="right")
    for diff in diffs:
        table.add_row(escape(diff.metric), *_numbers(diff), _ratio(diff))
    return table


def compare_files(
    a_path: Path, b_path: Path, console: Console, plots_dir: Path | None = None
) -> int:
    """Print how B differs from A (and plot their CDFs into ``plots_dir``); the exit code."""
    try:
        a, b = RunResult.load_json(a_path), RunResult.load_json(b_path)
    except ValueError as exc:
        console.print(f"tandem bench compare: {exc}", style="red", markup=False)
        return 2
    console.print(comparison_table(a, b, compare(a, b), (str(a_path), str(b_path))))
    if plots_dir is not None:
        from bench.harness.plots import plot_comparison  # matplotlib is slow to import

        for path in plot_comparison(a, b, plots_dir):
            console.print(f"plot: {path}", markup=False)
    return 0

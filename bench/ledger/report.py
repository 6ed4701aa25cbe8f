"""Tables of the ledger benchmarks (rich)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from bench.harness.summary import Stats
from bench.ledger.latency import FIGURES, LatencyOutput, RunResult
from bench.ledger.writes import BackendResult


def _f(value: float | None, digits: int = 1, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+,.{digits}f}" if signed else f"{value:,.{digits}f}"


def _p(stats: Stats | None, name: str, digits: int = 1) -> str:
    return "-" if stats is None else _f(float(getattr(stats, name)), digits)


def sustained_table(results: Sequence[BackendResult], flush_interval_s: float) -> Table:
    table = Table(
        title=f"LedgerWriter, sustained (flushes every {flush_interval_s:g} s): committed/s = "
        "records / (first submit -> flush() returned), checked against the ledger's row count; "
        "saturating = the loop never idles, paced = submits every 1 ms, the loop idles between"
    )
    for name in ("backend", "producer", "submitted", "committed", "end-to-end s", "committed/s",
                 "offered/s", "written/s while producing", "backlog at stop", "drain s",
                 "submit µs p50", "p99", "mean"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("backend", "producer") else "right")
    for result in results:
        for s in result.sustained:
            committed = f"{s.num_committed:,}"
            if s.num_committed != s.num_submitted or not s.flushed or s.num_write_failures:
                committed += f" (MISMATCH; flushed={s.flushed}, failures={s.num_write_failures})"
            table.add_row(
                result.backend,
                s.producer,
                f"{s.num_submitted:,}",
                committed,
                _f(s.end_to_end_s, 2),
                _f(s.committed_per_s, 0),
                _f(s.offered_per_s, 0),
                _f(s.written_per_s_while_producing, 0),
                f"{s.backlog:,}",
                _f(s.drain_s, 2),
                _p(s.submit_us, "p50", 2),
                _p(s.submit_us, "p99", 2),
                _p(s.submit_us, "mean", 2),
            )
    return table


def submit_table(results: Sequence[BackendResult]) -> Table:
    table = Table(
        title="LedgerWriter.submit() on the event loop, tight loop, database thread idle (µs)"
    )
    for name in ("backend", "calls", "p50", "p90", "p99", "mean", "max"):
        table.add_column(name, justify="left" if name == "backend" else "right")
    for result in results:
        stats = result.submit_idle_us
        table.add_row(
            result.backend,
            "-" if stats is None else f"{stats.n:,}",
            *(_p(stats, name, 2) for name in ("p50", "p90", "p99", "mean", "max")),
        )
    return table


def batch_table(results: Sequence[BackendResult]) -> Table:
    table = Table(
        title="store.insert_usage alone: one transaction per batch, batches back to back on one "
        "thread"
    )
    for name in ("backend", "batch", "records", "s", "rows/s", "batch ms p50", "p99"):
        table.add_column(name, justify="left" if name == "backend" else "right")
    for result in results:
        for batch in result.batches:
            table.add_row(
                result.backend,
                str(batch.batch_size),
                f"{batch.num_records:,}",
                _f(batch.wall_s, 2),
                _f(batch.rows_per_s, 0),
                _p(batch.batch_ms, "p50", 2),
                _p(batch.batch_ms, "p99", 2),
            )
    return table


def durability_lines(results: Sequence[BackendResult]) -> list[str]:
    return [f"{result.backend}: {result.durability}" for result in results]


_HEADERS = ("TTFT p50", "p90", "p99", "E2E p50", "p90", "p99", "req/s", "CPU ms/req")


def runs_table(runs: Sequence[RunResult]) -> Table:
    table = Table(
        title="Billing on vs off, run by run (ms; CPU: the gateway's, net of its idle rate)"
    )
    for name in ("run", "billing", "sent", "failed", *_HEADERS, "ledger rows / sent"):
        table.add_column(name, justify="left" if name in ("run", "billing") else "right")
    for index, run in enumerate(runs, start=1):
        figures = run.figures()
        summary = run.level.summary
        rows = "no ledger" if run.num_ledger_rows is None else f"{run.num_ledger_rows:,}"
        table.add_row(
            str(index),
            "on" if run.billing else "off",
            f"{summary.sent:,}",
            str(summary.failed) + (f" {summary.errors_by_type}" if summary.failed else ""),
            *_figure_cells(figures),
            f"{rows} / {run.num_sent:,}",
        )
    return table


def arms_table(output: LatencyOutput) -> Table:
    table = Table(title="Billing on vs off, per arm (mean of its two runs) and the difference")
    for name in ("arm", *_HEADERS):
        table.add_column(name, justify="left" if name == "arm" else "right")
    table.add_row("billing on", *_figure_cells(output.arm(True)))
    table.add_row("billing off", *_figure_cells(output.arm(False)))
    table.add_row("on - off", *_figure_cells(output.difference(), signed=True))
    return table


def _figure_cells(figures: dict[str, float | None], signed: bool = False) -> list[str]:
    digits = {"req_per_s": 1, "cpu_ms_per_request": 3}
    return [_f(figures[name], digits.get(name, 2), signed) for name in FIGURES]

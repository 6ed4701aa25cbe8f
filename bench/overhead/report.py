"""Tables of an overhead run (rich) and its JSON file."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from bench.overhead.measure import (
    ANCHORS,
    Cost,
    LevelResult,
    added_latency,
    find,
    ratio,
)
from bench.overhead.profile import Profile
from bench.overhead.trace_cost import MAX_ADDED_OFF, MAX_ADDED_ON, OFF, ON, TracingCost

DIRECT = "direct"


def _f(value: float | None, digits: int = 2, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def latency_table(results: Sequence[LevelResult]) -> Table:
    table = Table(title="Latency (ms) and throughput; + = added over direct at the same level")
    for name in ("target", "conc", "sent", "errors", "req/s", "TTFT p50", "TTFT p99", "ITL p50",
                 "ITL p99", "+TTFT p50", "+TTFT p99", "+ITL p50", "+ITL p99"):  # fmt: skip
        table.add_column(name, justify="left" if name == "target" else "right")
    for r in results:
        s, m = r.summary, r.summary.metrics
        ttft, itl = m.get("ttft"), m.get("itl")
        direct = find(results, DIRECT, r.concurrency)
        added = added_latency(s, direct.summary) if direct and r.target != DIRECT else None
        table.add_row(
            r.target,
            str(r.concurrency),
            str(s.sent),
            str(s.failed) + (f" {s.errors_by_type}" if s.failed else ""),
            _f(s.request_throughput, 1),
            _f(ttft.p50 if ttft else None),
            _f(ttft.p99 if ttft else None),
            _f(itl.p50 if itl else None),
            _f(itl.p99 if itl else None),
            _f(added.ttft_p50, signed=True) if added else "",
            _f(added.ttft_p99, signed=True) if added else "",
            _f(added.itl_p50, signed=True) if added else "",
            _f(added.itl_p99, signed=True) if added else "",
        )
    return table


def cpu_table(results: Sequence[LevelResult], where: str) -> Table:
    table = Table(
        title=f"CPU of the server under test in the measured phase (ms/request, ms/chunk: net "
        f"of its idle rate); {where}; others = cores used by processes outside the benchmark"
    )
    for name in ("target", "conc", "server CPU s", "wall s", "server cores", "idle ms/s",
                 "gross ms/req", "ms/request", "ms/chunk", "chunks/req", "engine ms/req",
                 "core busy", "others"):  # fmt: skip
        table.add_column(name, justify="left" if name == "target" else "right")
    for r in results:
        busy = " ".join(f"{core}:{_pct(share)}" for core, share in r.cpu.core_busy.items())
        table.add_row(
            r.target,
            str(r.concurrency),
            _f(r.cpu.server_s),
            _f(r.cpu.wall_s, 1),
            _f(r.server_core_share),
            _f(r.idle_cpu_ms_per_s, 1),
            _f(r.gross_cpu_ms_per_request, 3),
            _f(r.cpu_ms_per_request, 3),
            _f(r.cpu_ms_per_chunk, 4),
            _f(r.chunks_per_request, 1),
            _f(ratio(r.cpu.engine_s and r.cpu.engine_s * 1000, r.summary.sent), 3),
            busy,
            _f(r.cpu.others_cores),
        )
    return table


def memory_table(results: Sequence[LevelResult]) -> Table:
    """Resident memory of each server: idle, at its peak under each level, per open stream."""
    table = Table(
        title="Memory of the server under test (process and children): idle, peak while the "
        "level's streams were open, per open stream = (peak - idle) / concurrency (an upper "
        "bound), per added stream = the peak's growth from the level below / the streams "
        "added (the warm-up's one-time growth left out) - issue 24: under 50 KB per stream"
    )
    columns = ("target", "conc", "idle RSS MiB", "peak RSS MiB", "KiB/stream", "KiB/added")
    for name in columns:
        table.add_column(name, justify="left" if name == "target" else "right")
    before: dict[str, LevelResult] = {}  # each target's level run just before, in run order
    for r in results:
        if r.rss_peak_bytes is None:
            continue
        lower = before.get(r.target)
        before[r.target] = r
        if lower is not None and lower.concurrency >= r.concurrency:
            lower = None  # a peak never comes down: only growth to a larger level says much
        table.add_row(
            r.target,
            str(r.concurrency),
            _f(r.rss_idle_bytes and r.rss_idle_bytes / 2**20, 1),
            _f(r.rss_peak_bytes / 2**20, 1),
            _f(r.kb_per_stream, 1),
            _f(r.kb_per_added_stream(lower) if lower is not None else None, 1),
        )
    return table


def versus_table(
    results: Sequence[LevelResult], first: str, second: str, note: str = ""
) -> Table | None:
    """Two targets side by side at each concurrency both ran (A: ``first``, B: ``second``),
    with B's CPU per request and A's throughput as multiples of the other's."""
    levels = sorted(
        {r.concurrency for r in results if r.target == second}
        & {r.concurrency for r in results if r.target == first}
    )
    if not levels:
        return None
    title = f"A = {first} vs B = {second} (same fake engine, same load, same pinning){note}"
    table = Table(title=title)
    for name in ("conc", "CPU ms/req A", "B", "B/A", "req/s A", "B", "A/B", "+TTFT p50 A", "B",
                 "+TTFT p99 A", "B", "+ITL p99 A", "B"):  # fmt: skip
        table.add_column(name, justify="right")
    for level in levels:
        a, b = find(results, first, level), find(results, second, level)
        d = find(results, DIRECT, level)
        if a is None or b is None:
            continue
        added_a = added_latency(a.summary, d.summary) if d else None
        added_b = added_latency(b.summary, d.summary) if d else None
        table.add_row(
            str(level),
            _f(a.cpu_ms_per_request, 3),
            _f(b.cpu_ms_per_request, 3),
            _f(ratio(b.cpu_ms_per_request, a.cpu_ms_per_request), 1) + "x",
            _f(a.summary.request_throughput, 1),
            _f(b.summary.request_throughput, 1),
            _f(ratio(a.summary.request_throughput, b.summary.request_throughput), 1) + "x",
            _f(added_a.ttft_p50 if added_a else None, signed=True),
            _f(added_b.ttft_p50 if added_b else None, signed=True),
            _f(added_a.ttft_p99 if added_a else None, signed=True),
            _f(added_b.ttft_p99 if added_b else None, signed=True),
            _f(added_a.itl_p99 if added_a else None, signed=True),
            _f(added_b.itl_p99 if added_b else None, signed=True),
        )
    return table


def cost_table(fits: Mapping[str, Cost], chunks_per_request: float, how: str) -> Table:
    table = Table(title=f"CPU per request + per chunk ({how}) next to the anchors")
    for name in ("source", "ms/request", "ms/chunk", f"ms per {chunks_per_request:.0f}-chunk req"):
        table.add_column(name, justify="left" if name == "source" else "right")
    for source, cost in [*fits.items(), *ANCHORS.items()]:
        table.add_row(
            source,
            _f(cost.ms_per_request, 3),
            _f(cost.ms_per_chunk, 4),
            _f(cost.at(chunks_per_request), 2),
        )
    return table


def profile_tables(profile: Profile, title: str, n: int = 20) -> list[Table]:
    tables = []
    for label, counts, rows in (
        ("self time by package", profile.self_by_package, 15),
        ("inclusive time by package", _libraries(profile), 15),
        ("self time by function", profile.self_by_function, n),
        ("inclusive time, Tandem's own functions", _ours(profile), n),
    ):
        table = Table(title=f"{title}: {label} ({profile.num_samples} samples)")
        table.add_column("share", justify="right")
        table.add_column("samples", justify="right")
        table.add_column(label.split(" by ")[-1] if " by " in label else "function")
        for name, count, share in profile.top(counts, rows):
            table.add_row(_pct(share) if share >= 0.01 else f"{100 * share:.1f}%", str(count), name)
        tables.append(table)
    return tables


_OURS = ("gateway/", "admission/", "core/", "kv_transfer/", "moderation/", "workers/")
_EVERY_STACK = ("gateway", "<frozen runpy>")  # the entry point (gateway/cli/main.py) is on all


def _libraries(profile: Profile) -> Counter[str]:
    return Counter({k: v for k, v in profile.total_by_package.items() if k not in _EVERY_STACK})


def _ours(profile: Profile) -> Counter[str]:
    return Counter(
        {
            name: count
            for name, count in profile.total_by_function.items()
            if any(f"({prefix}" in name for prefix in _OURS)
        }
    )


def print_all(console: Console, tables: Sequence[Table | None]) -> None:
    for table in tables:
        if table is not None:
            console.print(table)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


def _added(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.2f} %"


def _holds(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "[red]NO[/]")


def tracing_table(costs: Sequence[TracingCost], fits: Mapping[str, Cost]) -> Table:
    """Tracing on vs off (the gateway's CPU, pooled rounds) and the tracing-off calls' share,
    next to the targets."""
    table = Table(
        title=f"What tracing costs the gateway: {OFF} (tracing off) vs {ON} (every request "
        "traced, exported over OTLP/HTTP); CPU net of idle"
    )
    for name in ("figure", "conc", "tracing off", "tracing on", "added", "target", "holds"):
        table.add_column(name, justify="left" if name == "figure" else "right")
    for cost in costs:
        rounds = cost.added_on_by_round
        spread = f" (rounds {_added(min(rounds))}..{_added(max(rounds))})" if rounds else ""
        table.add_row(
            f"CPU ms/request, {len(cost.off.runs)} rounds pooled{spread}",
            str(cost.concurrency),
            _f(cost.off.cpu_ms_per_request, 3),
            _f(cost.on.cpu_ms_per_request, 3),
            _added(cost.added_on),
            f"<= {100 * MAX_ADDED_ON:.0f} %",
            _holds(cost.on_holds),
        )
        chunk_increase = ratio(cost.on.cpu_ms_per_chunk, cost.off.cpu_ms_per_chunk)
        table.add_row(
            "CPU ms/chunk",
            str(cost.concurrency),
            _f(cost.off.cpu_ms_per_chunk, 4),
            _f(cost.on.cpu_ms_per_chunk, 4),
            _added(None if chunk_increase is None else chunk_increase - 1),
            "",
            "",
        )
        table.add_row(
            "tracing off: one request's tracing calls, CPU µs (share of ms/request off)",
            str(cost.concurrency),
            _f(cost.off_path_us, 2),
            "",
            _added(cost.added_off),
            f"<= {100 * MAX_ADDED_OFF:.0f} %",
            _holds(cost.off_holds),
        )
    off, on = fits.get(OFF), fits.get(ON)
    if off is not None and on is not None:
        for label, off_ms, on_ms, digits in (
            ("fit: fixed CPU ms per request", off.ms_per_request, on.ms_per_request, 3),
            ("fit: CPU ms per chunk", off.ms_per_chunk, on.ms_per_chunk, 4),
        ):
            increase = ratio(on_ms, off_ms)
            table.add_row(
                label, "", _f(off_ms, digits), _f(on_ms, digits),
                _added(None if increase is None else increase - 1), "", "",
            )  # fmt: skip
    return table

"""Reports, plots and comparisons of hand-made runs with known timings (real objects)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from bench.harness.compare import Difference, compare, compare_files, comparison_table
from bench.harness.plots import plot_comparison, plot_result
from bench.harness.records import RequestRecord
from bench.harness.report import print_result, summary_table, sweep_table, tenant_table
from bench.harness.result import RunResult
from bench.harness.summary import Slos, summarize, summarize_by_tenant

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def record(
    index: int,
    *,
    tenant: str = "default",
    ttft_ms: float = 100.0,
    itl_ms: float = 20.0,
    tokens: int = 5,
    sent_s: float | None = None,
    status: int = 200,
    error_type: str | None = None,
    warmup: bool = False,
) -> RequestRecord:
    """A streamed request: TTFT, then ``tokens - 1`` equal gaps (one chunk per token)."""
    sent = float(index) * 0.1 if sent_s is None else sent_s
    ok = status == 200 and error_type is None
    gaps = [itl_ms / 1000] * (tokens - 1) if ok else []
    e2e_s = (ttft_ms + itl_ms * (tokens - 1)) / 1000 if ok else 0.01
    return RequestRecord(
        index=index,
        tenant=tenant,
        warmup=warmup,
        scheduled_s=sent,
        max_tokens=tokens,
        expected_prompt_tokens=10,
        sent_s=sent,
        status=status,
        error_type=error_type,
        error=None if ok else "boom",
        ttft_s=ttft_ms / 1000 if ok else None,
        ttft_content_s=ttft_ms / 1000 if ok else None,
        itl_s=gaps,
        elapsed_s=e2e_s,
        e2e_s=e2e_s if ok else None,
        prompt_tokens=10 if ok else None,
        completion_tokens=tokens if ok else None,
        content_chunks=tokens if ok else 0,
        finish_reason="length" if ok else None,
    )


def run_of(
    label: str,
    records: list[RequestRecord],
    slos: Slos | None = None,
    sweep: list[dict[str, object]] | None = None,
) -> RunResult:
    slos = slos or Slos()
    summary = summarize(records, slos)
    return RunResult(
        label=label,
        config={
            "target": {"url": "http://127.0.0.1:8000/v1/chat/completions", "model": "m"},
            "shape_description": "poisson 4 req/s",
            "num_requests": len(records),
            "slos": slos.to_dict(),
            "slo_attainment": 0.9,
        },
        summary=summary,
        tenants=summarize_by_tenant(records, slos, summary.duration_s),
        records=records,
        started_at="2025-01-01T00:00:00+00:00",
        sweep=sweep or [],
    )


def single(label: str = "base", ttft_ms: float = 100.0, itl_ms: float = 20.0) -> RunResult:
    records = [record(i, ttft_ms=ttft_ms, itl_ms=itl_ms) for i in range(10)]
    return run_of(label, [record(99, ttft_ms=5000, warmup=True), *records])


def two_tenants() -> RunResult:
    records = [record(i, tenant="gold", ttft_ms=80) for i in range(6)]
    records += [record(6 + i, tenant="free", ttft_ms=400, itl_ms=30) for i in range(6)]
    records.append(record(12, tenant="free", status=429, error_type="rate_limit_exceeded"))
    return run_of("mix", records, Slos(ttft_ms=200))


def swept() -> RunResult:
    """Rates 1, 2, 4, 8: TTFT grows with load; the SLO (ttft 500 ms) holds up to 4 req/s."""
    slos = Slos(ttft_ms=500)
    points = []
    for rate, ttft in ((1, 100), (2, 200), (4, 450), (8, 2000)):
        summary = summarize([record(i, ttft_ms=ttft) for i in range(10)], slos)
        points.append({"rate": rate, "summary": summary.to_dict(), "meets_slos": ttft < 500})
    return run_of("sweep", [record(i, ttft_ms=450) for i in range(10)], slos, points)


def text_of(renderable: object) -> str:
    console = Console(record=True, width=200)
    console.print(renderable)
    return console.export_text()


def cells(text: str, first: str) -> list[str]:
    """The cells of the table row starting with ``first`` (box characters dropped)."""
    for line in text.splitlines():
        row = line.replace("│", " ").split()
        if row[:1] == [first]:
            return row
    raise AssertionError(f"no row {first!r} in:\n{text}")


def by_metric(diffs: list[Difference]) -> dict[str, Difference]:
    return {d.metric: d for d in diffs}


def test_compare_ratios_and_directions() -> None:
    diffs = by_metric(compare(single("a", ttft_ms=100), single("b", ttft_ms=50, itl_ms=10)))
    ttft = diffs["ttft p50 (ms)"]
    assert ttft.a == pytest.approx(100)
    assert ttft.b == pytest.approx(50)
    assert ttft.ratio == pytest.approx(0.5)
    assert ttft.delta == pytest.approx(-50)
    assert ttft.better is True
    assert diffs["itl p99 (ms)"].ratio == pytest.approx(0.5)
    # Faster streams finish sooner: the same requests in less time is more throughput.
    throughput = diffs["request throughput (req/s)"]
    assert throughput.b is not None and throughput.a is not None and throughput.b > throughput.a
    assert throughput.better is True
    assert diffs["sent"].better is None  # a count says nothing about better or worse
    assert diffs["sent"].ratio == 1
    assert "queue p50 (ms)" not in diffs  # neither run had a queue time


def test_difference_direction_and_undefined_ratio() -> None:
    assert Difference("e2e p50 (ms)", 100, 120, higher_is_better=False).better is False
    assert Difference("goodput (req/s)", 2, 3, higher_is_better=True).better is True
    assert Difference("goodput (req/s)", 2, 1, higher_is_better=True).better is False
    assert Difference("failed", 0, 3, higher_is_better=False).ratio is None
    missing = Difference("queue p50 (ms)", None, 4.0, higher_is_better=False)
    assert (missing.delta, missing.ratio, missing.better) == (None, None, None)


def test_compare_per_tenant_rows() -> None:
    diffs = by_metric(compare(two_tenants(), two_tenants()))
    assert diffs["tenant free: ttft p50 (ms)"].a == pytest.approx(400)
    assert diffs["tenant gold: ttft p50 (ms)"].ratio == pytest.approx(1)
    assert diffs["failed"].a == 1
    # A single-tenant run gets no tenant rows (they would repeat the overall ones).
    assert not any(m.startswith("tenant") for m in by_metric(compare(single(), single())))


def test_comparison_table_colours_regressions() -> None:
    a, b = single("a", ttft_ms=100), single("b", ttft_ms=200)
    console = Console(record=True, width=200, force_terminal=True, color_system="standard")
    console.print(comparison_table(a, b, compare(a, b), ("a.json", "b.json")))
    styled = console.export_text(styles=True, clear=False)
    plain = console.export_text()
    assert "A: a (a.json)  vs  B: b (b.json)" in plain
    assert cells(plain, "ttft")[3:] == ["100.0", "200.0", "+100.0", "2.00x"]  # ttft p50 (ms)
    assert "\x1b[31m2.00x" in styled  # red: twice the TTFT is worse


def test_compare_files_round_trip(tmp_path: Path) -> None:
    a_path, b_path = tmp_path / "a.json", tmp_path / "b.json"
    single("a", ttft_ms=100).save_json(a_path)
    two_tenants().save_json(b_path)
    console = Console(record=True, width=200)
    assert compare_files(a_path, b_path, console, plots_dir=tmp_path / "plots") == 0
    out = console.export_text()
    assert "ttft p50 (ms)" in out and "a.json" in out
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "compare_itl_cdf.png",
        "compare_ttft_cdf.png",
    ]


@pytest.mark.parametrize("content", [b"not json {", b"[1, 2]", b'{"format": "other"}'])
def test_compare_files_rejects_garbage(tmp_path: Path, content: bytes) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    single().save_json(good)
    bad.write_bytes(content)
    console = Console(record=True, width=200)
    assert compare_files(good, bad, console) == 2
    out = console.export_text()
    assert out.startswith("tandem bench compare: ")
    assert "bad.json" in out
    assert "Traceback" not in out
    assert compare_files(tmp_path / "missing.json", good, Console(record=True)) == 2


def test_summary_table_shows_headline_latencies_and_errors() -> None:
    out = text_of(summary_table(two_tenants()))
    assert "http://127.0.0.1:8000/v1/chat/completions, model m" in out
    assert "poisson 4 req/s" in out
    assert "sent 13, completed 12, failed 1 (malformed 0)" in out
    assert "TTFT to first chunk" in out
    assert "SLO attainment 46.2% with ttft <= 200 ms" in out  # 6 of 13 within 200 ms
    assert cells(out, "ttft")[1:4] == ["12", "240.0", "240.0"]  # n, mean, p50
    assert "rate_limit_exceeded" in out and "429" in out
    assert "queue" not in out.split()  # no queue times were reported


def test_summary_excludes_warmup_and_skips_goodput_without_slos() -> None:
    out = text_of(summary_table(single()))
    assert "sent 10," in out
    assert "goodput" not in out
    assert "5000" not in out  # the warm-up request's TTFT


def test_tenant_table_rows() -> None:
    out = text_of(tenant_table(two_tenants()))
    rows = {name: cells(out, name) for name in ("gold", "free")}
    assert rows["gold"][1:4] == ["6", "6", "0"]
    assert rows["free"][1:4] == ["7", "6", "1"]
    assert rows["gold"][6] == "80.0" and rows["free"][6] == "400.0"  # ttft p50
    assert rows["gold"][-1] == "100.0%" and rows["free"][-1] == "0.0%"


def test_sweep_table_names_highest_passing_rate() -> None:
    out = text_of(sweep_table(swept()))
    assert "highest rate meeting the SLOs: 4 req/s" in out
    assert cells(out, "4")[-1] == "yes"
    assert cells(out, "8")[2] == "2000" and cells(out, "8")[-1] == "no"


def test_print_result_prints_what_applies() -> None:
    console = Console(record=True, width=200)
    print_result(two_tenants(), console)
    out = console.export_text()
    assert "tenants of mix" in out and "sweep of" not in out
    console = Console(record=True, width=200)
    print_result(swept(), console)
    out = console.export_text()
    assert "sweep of sweep" in out and "tenants of" not in out


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (single(), {"ttft_cdf.png", "itl_cdf.png"}),
        (two_tenants(), {"ttft_cdf.png", "itl_cdf.png", "tenants.png"}),
        (swept(), {"ttft_cdf.png", "itl_cdf.png", "latency_vs_load.png"}),
    ],
    ids=["single", "tenants", "sweep"],
)
def test_plot_result_writes_pngs(tmp_path: Path, result: RunResult, expected: set[str]) -> None:
    paths = plot_result(result, tmp_path / "plots")
    assert {p.name for p in paths} == expected
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC


def test_plot_comparison_writes_pngs(tmp_path: Path) -> None:
    paths = plot_comparison(single("a"), single("a", ttft_ms=50), tmp_path)
    assert [p.name for p in paths] == ["compare_ttft_cdf.png", "compare_itl_cdf.png"]
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC
